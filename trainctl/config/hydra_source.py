"""Hydra reads trainctl's configs through this config source, by name: what `sources` lists, nothing else.

Hydra's file source joins a defaults-list entry to its folder (`override /model: ../../x` is
`DIR/model/../../x.yaml`, `realpath` and all), so any YAML on disk could load. This source serves
the primary config and the options of the catalog (`sources.Catalog`) by exact `GROUP/NAME`
lookup: a path that is not a listed option does not exist, whatever its dots and slashes. Hydra
also searches its own package (`pkg://hydra.conf`), which resolves `..` too; so every defaults
entry of every file this source serves is checked before Hydra sees it (`defaults_problems`):
a group of ours or a recipe, by plain names only. Each file is read with the bounds of
`yaml_files`; a file's problems are `ConfigError` lines naming it. Composing needs no folder on
disk: nothing is left behind, whatever ends the process.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from hydra import version
from hydra._internal.hydra import Hydra
from hydra._internal.utils import create_config_search_path
from hydra.core.object_type import ObjectType
from hydra.core.plugins import Plugins
from hydra.plugins.config_source import ConfigResult, ConfigSource
from omegaconf import OmegaConf

from trainctl.config import yaml_files
from trainctl.config.errors import ConfigError
from trainctl.config.memo import CopyingCache
from trainctl.config.sources import PRIMARY_NAME, RECIPE, Catalog, is_plain_name

SCHEME = "trainctl"
SCHEMA_NAME = "trainctl_schema"
_KEYWORDS = ("optional", "override")
_catalogs: dict[str, Catalog] = {}
_tokens = itertools.count()
# A file's parse by (path, group, text): every composition loads every file of its defaults list again, and the
# unit tier composes ~1500 times. Keyed by the text just read, so an edited file is parsed afresh; the data is
# handed out as a copy (OmegaConf.create keeps no reference, but Hydra's callers may change what they get).
_parsed: CopyingCache[tuple[object, list[str], dict]] = CopyingCache(256)


class TrainctlSource(ConfigSource):
    """The primary config and the catalog's options, by `GROUP/NAME`; everything else does not exist."""

    def __init__(self, provider: str, path: str) -> None:
        super().__init__(provider=provider, path=path)
        self.catalog = _catalogs[self.path]

    @staticmethod
    def scheme() -> str:
        return SCHEME

    def _file(self, config_path: str) -> Path | None:
        return config_file(self.catalog, config_path[: -len(".yaml")] if config_path.endswith(".yaml") else config_path)

    def load_config(self, config_path: str) -> ConfigResult:
        path = self._file(config_path)
        if path is None:  # Hydra asks only for what is_config confirmed
            raise ConfigError([f"{config_path}: not a config of the declared folders"])
        group = config_path.partition("/")[0] if "/" in config_path else ""
        data, problems, header = _parse(path, group, yaml_files.read_text(path))
        if problems:
            raise ConfigError(problems)
        config = OmegaConf.create(data if data is not None else {})
        return ConfigResult(config=config, path=f"{SCHEME}://{self.path}", provider=self.provider, header=header)

    def available(self) -> bool:
        return True

    def is_group(self, config_path: str) -> bool:
        return config_path == "" or config_path in self.catalog.groups

    def is_config(self, config_path: str) -> bool:
        return self._file(config_path) is not None

    def list(self, config_path: str, results_filter: ObjectType | None) -> list[str]:
        found = []
        if config_path == "":
            if results_filter in (None, ObjectType.GROUP):
                found += list(self.catalog.groups)
            if results_filter in (None, ObjectType.CONFIG):
                found.append(PRIMARY_NAME)
        elif config_path in self.catalog.groups and results_filter in (None, ObjectType.CONFIG):
            found += list(self.catalog.groups[config_path])
        return sorted(found)


Plugins.instance().register(TrainctlSource)


def _parse(path: Path, group: str, text: str) -> tuple[object, list[str], dict]:
    """The file's data, its problems and its header; a syntax error raises (and is not kept)."""
    def build() -> tuple[object, list[str], dict]:
        data = yaml_files.parse(text, str(path))
        return data, file_problems(path, group, data), _header(path, text, group)

    return _parsed.get_or_build((str(path), group, text), build)


class initialize_catalog:  # noqa: N801 (a context manager used like Hydra's initialize_config_dir)
    """Hydra initialized to compose from `catalog` (and Hydra's own package), for one composition."""

    def __init__(self, catalog: Catalog) -> None:
        self.token = str(next(_tokens))
        _catalogs[self.token] = catalog
        try:
            version.setbase("1.3")
            # What initialize_config_dir does, with this source instead of a folder.
            Hydra.create_main_hydra2(task_name="trainctl",
                                     config_search_path=create_config_search_path(f"{SCHEME}://{self.token}"))
        except BaseException:
            _catalogs.pop(self.token, None)
            raise

    def __enter__(self) -> initialize_catalog:
        return self

    def __exit__(self, *exc) -> None:
        _catalogs.pop(self.token, None)


def _header(path: Path, text: str, group: str) -> dict:
    """The `# @package` header; a recipe without one is global (its keys are the run's keys)."""
    try:
        header = ConfigSource._get_header_dict(text[:512])
    except ValueError as exc:
        raise ConfigError([f"{path}: {exc}; the header is one line `# @package _global_`"]) from None
    package = header.get("package")
    if package is None and group == RECIPE:
        header["package"] = "_global_"
    elif package is not None and _is_hydra_package(package):
        raise ConfigError([f"{path}: `# @package {package}` writes Hydra's own settings; "
                           "use `# @package _global_` or no header"])
    return header


def file_problems(path: Path, group: str, data) -> list[str]:
    """What is wrong with a config file's top level and its defaults list (file-named lines)."""
    if data is None:
        return []
    if not isinstance(data, dict):
        kind = "a list" if isinstance(data, list) else f"the single value {str(data)[:40]!r}"
        return [f"{path}: holds {kind}; a config file is a mapping of keys to values (key: value lines)"]
    if group and "hydra" in data:
        return [f"{path}: hydra: Hydra's own settings cannot be set in a config file; remove the hydra: key"]
    if odd := _odd_keys(data):
        return [f"{path}: the key {odd[0]!r} is not a name; keys are names such as train or steps"]
    if "defaults" not in data:
        return []
    defaults = data["defaults"]
    if not isinstance(defaults, list):
        return [f"{path}: defaults: must be a list of entries (- override /model: NAME)"]
    return defaults_problems(path, group, defaults)


def _odd_keys(node) -> list:
    """The mapping keys anywhere in `node` that are not strings (null, numbers, true), first found first."""
    if isinstance(node, dict):
        found = [key for key in node if not isinstance(key, str)]
        return found or [k for value in node.values() for k in _odd_keys(value)][:1]
    if isinstance(node, list):
        return [k for item in node for k in _odd_keys(item)][:1]
    return []


def defaults_problems(path: Path, group: str, entries: list) -> list[str]:
    """Each defaults entry must name, by plain names, an option of a group of ours (or a recipe)."""
    problems = []
    if sum(1 for entry in entries if entry == "_self_") > 1:
        problems.append(f"{path}: defaults: _self_ appears more than once; keep one")
    for entry in entries:
        why = _entry_problem(entry, group)
        if why:
            problems.append(f"{path}: defaults entry {_show(entry)}: {why}")
    return problems


def _show(entry) -> str:
    text = f"'{next(iter(entry))}: {next(iter(entry.values()))}'" if isinstance(entry, dict) and entry else repr(entry)
    return text if len(text) <= 120 else text[:117] + "...'"


_WHERE = "an entry names an option of a group by its plain name; only the config folders' options load"


def _entry_problem(entry, group: str) -> str | None:
    if entry == "_self_":
        return None
    if isinstance(entry, str):
        return _config_path_problem(entry, group)
    if not isinstance(entry, dict) or len(entry) != 1:
        return "an entry is `- override /GROUP: NAME`, `- /GROUP/NAME` or `- _self_`"
    (key, value), = entry.items()
    if not isinstance(key, str):
        return "an entry is `- override /GROUP: NAME`, `- /GROUP/NAME` or `- _self_`"
    words = key.split()
    target, keywords = (words[-1], words[:-1]) if words else ("", [])
    if any(word not in _KEYWORDS for word in keywords):
        return f"unknown keyword in {key!r}; only optional and override come before the group"
    group_path, _, package = target.partition("@")
    if package and _is_hydra_package(package):
        return "the package @hydra... writes Hydra's own settings; " + _WHERE
    absolute = group_path.startswith("/")
    name = group_path.lstrip("/") if absolute else (f"{group}/{group_path}" if group else group_path)
    if name not in _groups():
        hint = f" (in a {group} file a group is named from the root: /{group_path})" if not absolute and group else ""
        return f"{group_path!r} is not a group of trainctl{hint}; {_WHERE}"
    values = value if isinstance(value, list) else [value]
    for option in values:
        if option is None or option == "???":
            continue
        if not isinstance(option, str) or not is_plain_name(option):
            return f"{option!r} is not an option name (letters, digits, _ . -; no paths); {_WHERE}"
    return None


def _config_path_problem(entry: str, group: str) -> str | None:
    """A config named by path (`- /model/tiny`, `- other_recipe` in a recipe): GROUP/NAME of ours, plainly."""
    target, _, package = entry.partition("@")
    if package and _is_hydra_package(package):
        return "the package @hydra... writes Hydra's own settings; " + _WHERE
    if not group and target == SCHEMA_NAME:
        return None  # the primary config's typed schema (the ConfigStore entry compose registers)
    absolute = target.startswith("/")
    path = target.lstrip("/") if absolute else (f"{group}/{target}" if group else target)
    parts = path.split("/")
    if len(parts) != 2 or parts[0] not in _groups() or not is_plain_name(parts[1]):
        return f"{target!r} is not GROUP/NAME of trainctl's options; {_WHERE}"
    return None


def _groups() -> tuple[str, ...]:
    from trainctl.config.schema import GROUPS

    return (*GROUPS, RECIPE)


def _is_hydra_package(package: str) -> bool:
    parts = package.split(".")
    return parts[0] == "hydra" or (parts[0] == "_global_" and parts[1:2] == ["hydra"])


def include_cycle(cat: Catalog, starts: list[str]) -> list[str] | None:
    """A chain of configs (GROUP/NAME) whose defaults entries lead back to its first, from any of `starts`."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        if state.get(node) == 1:
            return path[path.index(node):] + [node]
        if state.get(node) == 2:
            return None
        state[node] = 1
        for target in _includes(cat, node):
            if found := visit(target, path + [node]):
                return found
        state[node] = 2
        return None

    for start in starts:
        if found := visit(start, []):
            return found
    return None


def own_group_includer(cat: Catalog, starts: list[str]) -> str | None:
    """A config reachable from `starts` whose defaults name an option of its own group (Hydra then includes
    that group again from inside it, without end when the same choice applies there)."""
    seen: set[str] = set()
    todo = list(starts)
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        targets = _includes(cat, node)
        group = node.partition("/")[0] if "/" in node else ""
        if group and any(t.partition("/")[0] == group for t in targets):
            return node
        todo += targets
    return None


def config_file(cat: Catalog, config_path: str) -> Path | None:
    if config_path == PRIMARY_NAME:
        return cat.primary
    group, _, name = config_path.partition("/")
    opt = cat.groups.get(group, {}).get(name)
    return None if opt is None else opt.path


def _includes(cat: Catalog, config_path: str) -> list[str]:
    """The configs a config's defaults entries name (GROUP/NAME), as far as they are plain names."""
    path = config_file(cat, config_path)
    try:
        data = yaml_files.load(path) if path is not None else None
    except ConfigError:
        return []
    entries = data.get("defaults") if isinstance(data, dict) else None
    group = config_path.partition("/")[0] if "/" in config_path else ""
    found = []
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, str) and entry != "_self_" and not _config_path_problem(entry, group):
            target = entry.partition("@")[0]
            found.append(target.lstrip("/") if target.startswith("/") or not group else f"{group}/{target}")
        elif isinstance(entry, dict) and len(entry) == 1 and not _entry_problem(entry, group):
            (key, value), = entry.items()
            group_path = key.split()[-1].partition("@")[0]
            name = group_path.lstrip("/") if group_path.startswith("/") or not group else f"{group}/{group_path}"
            found += [f"{name}/{v}" for v in (value if isinstance(value, list) else [value]) if isinstance(v, str)]
    return found
