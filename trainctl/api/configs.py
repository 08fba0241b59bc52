"""Where configs and runs are: the search path of config folders, a resolved config, the runs folder."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from trainctl.api.arguments import checked
from trainctl.config import sources
from trainctl.config.schema import RunConfig
from trainctl.config.validate import resolve
from trainctl.core.errors import UserError


def _composer():
    """trainctl.config.compose, imported where a command composes: Hydra's import is about a third of the CLI's
    start, which the commands that only read runs (status, runs, logs, eval, export...) do not need."""
    from trainctl.config import compose

    return compose


# Config folders as a caller gives them: paths (--config-dir), an already built search path, or None.
ConfigDirs = sources.SearchPath | Sequence[Path | str] | None


@checked
def search(config_dirs: ConfigDirs = None) -> sources.SearchPath:
    """The config folders to compose from: the given ones, then $TRAINCTL_CONFIG_PATH's, then the shipped ones."""
    if isinstance(config_dirs, sources.SearchPath):
        return config_dirs
    return sources.search_path([str(d) for d in config_dirs or []])


@checked
def shadow_notes(sp: sources.SearchPath) -> list[str]:
    """One line for each user option that hides a shipped one of the same name."""
    return [f"note: {winner.group} {winner.name} from {winner.path} shadows the shipped one"
            for winner, _hidden in sources.shadowed(sp)]


@checked
def recipes(config_dirs: ConfigDirs = None) -> list[tuple[str, str, str]]:
    """(name, description, where it comes from) of every recipe."""
    sp = search(config_dirs)
    return [(name, _composer().recipe_description(name, sp), sources.describe_origin(opt))
            for name, opt in sources.options("recipe", sp).items()]


@checked
def groups(config_dirs: ConfigDirs = None) -> list[tuple[str, str, str, str]]:
    """(group, its options, the default option, the user's own options with their files) of every config group."""
    from trainctl.config.schema import GROUPS, option_of

    sp = search(config_dirs)
    defaults = _composer().compose_dictconfig([], sp)
    rows = []
    for group in (*GROUPS, "recipe"):
        found = sources.options(group, sp)
        default = option_of(group, defaults[group]) if group in GROUPS else "(none)"
        mine = ", ".join(f"{name} ({opt.path})" for name, opt in found.items() if not opt.shipped)
        rows.append((group, ", ".join(found), default, mine or "-"))
    return rows


@checked
def cwd_problem() -> str | None:
    """Every command resolves relative paths (runs/, data, configs) against the working directory; a deleted one
    would fail deep inside Hydra or a launch. One line instead."""
    try:
        os.getcwd()
    except OSError as exc:
        return (f"the working directory cannot be read ({exc.strerror or exc}; deleted?); "
                "cd to an existing directory and run the command again")
    return None


def override_list(overrides: Sequence[str] | None) -> list[str]:
    """The overrides as a list of strings. One string would be read character by character (a str is a sequence
    of str), so it is refused, as is any item that is not a string, each in one line."""
    if overrides is None:
        return []
    if isinstance(overrides, (str, bytes)):
        return _refuse_one_string(overrides)
    items = list(overrides)
    wrong = [f"overrides[{i}]={item!r}: an override is a string such as 'optim.lr=1e-3'"
             for i, item in enumerate(items) if not isinstance(item, str)]
    if wrong:
        raise UserError(wrong)
    return items


def _refuse_one_string(text: str | bytes) -> list[str]:
    example = repr(text.split()) if isinstance(text, str) and text.split() else "['recipe=tiny_cpu', 'optim.lr=1e-3']"
    raise UserError([f"overrides={text!r}: give a list of strings, one override each (e.g. {example}), "
                     "not one string"])


@checked
def resolved(overrides: Sequence[str] | None = None, config_dirs: ConfigDirs = None) -> RunConfig:
    """The composed, validated and derived config of one run; a sweep's overrides are refused (see `api.sweep`)."""
    from trainctl.launch.sweep import is_sweep

    overrides = override_list(overrides)
    if swept := is_sweep(overrides):
        raise UserError([f"{item}: several values (a sweep); `trainctl launch -m ...` runs one run per point"
                         for item in swept])
    return resolve(_composer().compose(overrides, search(config_dirs)))


@checked
def env_runs_dir() -> Path:
    """$TRAINCTL_RUNS_DIR, else runs/: an empty or blank variable counts as unset (as the config reads it)."""
    return Path(os.environ.get("TRAINCTL_RUNS_DIR", "").strip() or "runs")


@checked
def runs_dir_of(runs_dir: Path | str | None = None, overrides: Sequence[str] | None = None,
                config_dirs: ConfigDirs = None) -> Path:
    """`runs_dir`, else the runs_dir of the config the overrides compose (recipe=..., runs_dir=...), else
    $TRAINCTL_RUNS_DIR, else runs/."""
    if runs_dir is not None:
        return Path(runs_dir)
    if overrides or config_dirs:
        return Path(_composer().compose(override_list(overrides), search(config_dirs)).runs_dir.strip() or "runs")
    return env_runs_dir()


@checked
def find_run(run: str | Path, runs_dir: Path | str | None = None) -> Path:
    """A run directory given as a path or as a name under runs_dir (default: $TRAINCTL_RUNS_DIR, else runs/)."""
    from trainctl.runs import registry as runs

    return runs.find_run(str(run), runs_dir_of(runs_dir))
