"""Where config options come from: the shipped configs, the user's config directories, a recipe file.

The shipped configs are the repository's top-level `conf/` (`config.yaml`, one folder per group) and
`recipes/`. A checkout (editable install included) reads them there; a built wheel carries copies as
package data (`trainctl/conf/`, `trainctl/recipes/`, copied in by setup.py's build_py), so a wheel
installed anywhere finds them. A user adds options with `--config-dir DIR` (repeatable) or
`TRAINCTL_CONFIG_PATH=DIR1:DIR2`, one folder holding both kinds (`DIR/model/*.yaml`, `DIR/recipes/*.yaml`,
...), and may name a recipe file directly (`recipe=path/to/foo.yaml`).

Precedence: `--config-dir` folders in the order given, then `TRAINCTL_CONFIG_PATH`, then the shipped
configs; the first folder holding an option wins, and `shadowed()` names every user option that hides a
shipped one. Only the group folders and `recipes/` of the declared folders are read: a folder's own
`config.yaml` or any other file never loads.

Hydra composes from a `Catalog`: the primary config and the winning file of every option, by group and
name. It reads them through `hydra_source`, which serves exactly what the catalog lists (no folder is
searched, none is made), so what it can reach is exactly what this module listed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from trainctl.config.errors import ConfigError
from trainctl.config.schema import GROUPS

ENV_VAR = "TRAINCTL_CONFIG_PATH"
PRIMARY_FILE = "config.yaml"
PRIMARY_NAME = "config"
RECIPE = "recipe"
# The folder of a group inside a config directory: groups keep their own name; recipes live in recipes/.
RECIPES_FOLDER = "recipes"
# The shipped group folders and config.yaml: the top-level conf/ of a checkout, trainctl/conf/ of a wheel.
CONF_FOLDER = "conf"
SHIPPED = "shipped"
YAML_SUFFIXES = (".yaml", ".yml")
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def is_plain_name(name: str) -> bool:
    """An option's name is a file name without `.yaml`: letters, digits, _ . -; no separator, no `..`."""
    return bool(_PLAIN_NAME.match(name)) and ".." not in name


PACKAGE_DIR = Path(__file__).resolve().parents[1]


def shipped_base(package: Path = PACKAGE_DIR) -> Path:
    """The folder holding the shipped conf/ and recipes/: the package in a built wheel, else the checkout.

    Only a wheel's build copies them into the package; a checkout keeps them at its top level, once.
    """
    return package if (package / CONF_FOLDER / PRIMARY_FILE).is_file() else package.parent


def shipped_dir() -> Path:
    """The shipped group folders and primary config.yaml (conf/)."""
    return shipped_base() / CONF_FOLDER


def shipped_recipes_dir() -> Path:
    """The shipped recipes (recipes/)."""
    return shipped_base() / RECIPES_FOLDER


@dataclass(frozen=True)
class Root:
    """One config folder as searched: where its groups' folders and its recipes are, and its origin."""

    groups: Path
    recipes: Path
    origin: str

    def folder(self, group: str) -> Path:
        return self.recipes if group == RECIPE else self.groups / group


def user_root(folder: Path) -> Root:
    """A user's config folder holds both kinds: DIR/GROUP/*.yaml and DIR/recipes/*.yaml."""
    return Root(folder, folder / RECIPES_FOLDER, str(folder))


def shipped_root() -> Root:
    return Root(shipped_dir(), shipped_recipes_dir(), SHIPPED)


@dataclass(frozen=True)
class Option:
    """One option of a group: its name, its file, and where it came from (`shipped` or the user folder)."""

    group: str
    name: str
    path: Path
    origin: str

    @property
    def shipped(self) -> bool:
        return self.origin == SHIPPED


@dataclass(frozen=True)
class SearchPath:
    """The user's config folders, highest precedence first, before the shipped ones."""

    user_dirs: tuple[Path, ...] = ()
    recipe_file: Path | None = None  # recipe=path/to/foo.yaml, taken as recipe `foo` above every folder

    def roots(self) -> list[Root]:
        return [*(user_root(d) for d in self.user_dirs), shipped_root()]

    def with_recipe_file(self, path: Path) -> SearchPath:
        return SearchPath(self.user_dirs, path)


def search_path(cli_dirs: Sequence[str] = (), environ: dict | None = None) -> SearchPath:
    """`--config-dir` folders then `TRAINCTL_CONFIG_PATH`'s, checked; every bad one named on its own line."""
    env = os.environ if environ is None else environ
    given = [(d, "--config-dir") for d in cli_dirs]
    given += [(d, ENV_VAR) for d in env.get(ENV_VAR, "").split(os.pathsep) if d.strip()]
    dirs, problems = [], []
    shipped = (shipped_dir(), shipped_base())  # naming the shipped folders again adds nothing (and shadows nothing)
    for raw, where in given:
        path = Path(raw).expanduser()
        if not path.is_dir():
            what = "does not exist" if not path.exists() else "is not a directory"
            problems.append(f"{where} {raw}: {what}; a config directory holds group folders "
                            f"({', '.join(GROUPS[:3])}, ...) and {RECIPES_FOLDER}/ of YAML files")
            continue
        resolved = path.resolve()
        if resolved not in shipped and resolved not in dirs:
            dirs.append(resolved)
    if problems:
        raise ConfigError(problems)
    return SearchPath(tuple(dirs))


def _files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.suffix in YAML_SUFFIXES and is_plain_name(p.stem)
                  and p.is_file())


def all_options(group: str, sp: SearchPath) -> list[Option]:
    """Every file of a group in every folder, highest precedence first (shadowed ones included)."""
    found = []
    if group == RECIPE and sp.recipe_file is not None:
        found.append(Option(group, sp.recipe_file.stem, sp.recipe_file, str(sp.recipe_file.parent)))
    for root in sp.roots():
        found += [Option(group, p.stem, p, root.origin) for p in _files(root.folder(group))]
    return found


def options(group: str, sp: SearchPath) -> dict[str, Option]:
    """The option each name resolves to (the first folder wins), sorted by name."""
    chosen: dict[str, Option] = {}
    for opt in all_options(group, sp):
        chosen.setdefault(opt.name, opt)
    return dict(sorted(chosen.items()))


def shadowed(sp: SearchPath) -> list[tuple[Option, Option]]:
    """(winner, hidden) pairs where a user option hides a shipped one of the same group and name."""
    pairs = []
    for group in (*GROUPS, RECIPE):
        winners = options(group, sp)
        for opt in all_options(group, sp):
            winner = winners[opt.name]
            if opt.shipped and not winner.shipped:
                pairs.append((winner, opt))
    return pairs


def describe_origin(opt: Option) -> str:
    return "shipped" if opt.shipped else str(opt.path)


def recipe_file_problem(value: str) -> str | None:
    """Why `recipe=VALUE` (a path) cannot be loaded, or None."""
    path = Path(value).expanduser()
    if path.suffix not in YAML_SUFFIXES:
        return f"recipe={value}: a recipe file must end in .yaml; or pass recipe=NAME"
    if not path.exists():
        return f"recipe={value}: no such file; pass an existing recipe .yaml, or recipe=NAME (see `trainctl recipes`)"
    if not path.is_file():
        return f"recipe={value}: not a regular file; pass a recipe .yaml file, or recipe=NAME (see `trainctl recipes`)"
    if not _PLAIN_NAME.match(path.stem):
        return f"recipe={value}: the file name must be letters, digits, _ . - (it becomes the recipe's name)"
    return None


def is_path_like(value: str) -> bool:
    return "/" in value or value.endswith(YAML_SUFFIXES) or value.startswith("~")


@dataclass(frozen=True)
class Catalog:
    """What one composition may load: the shipped primary config and each group's winning options by name."""

    primary: Path
    groups: dict[str, dict[str, Option]]


def catalog(sp: SearchPath) -> Catalog:
    return Catalog(shipped_dir() / PRIMARY_FILE, {group: options(group, sp) for group in (*GROUPS, RECIPE)})
