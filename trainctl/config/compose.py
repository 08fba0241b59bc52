"""Compose conf/ groups, a recipe and the user's overrides into a typed RunConfig.

Hydra's compose API does the composition and its override grammar (`key=value`,
`group=option`, `+key=value`, `~key`, lists); the structured schema makes unknown
keys and wrong types fail with the key's full path. Every failure becomes a
`ConfigError` whose lines are ready to print.
"""

from __future__ import annotations

import re
from pathlib import Path

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from trainctl.config.errors import ConfigError
from trainctl.config.schema import GROUPS, RunConfig, from_dict, structured_schema

SCHEMA_NAME = "trainctl_schema"
PRIMARY = "config"


def project_root() -> Path:
    """The folder holding conf/ and recipes/ (the source checkout)."""
    return Path(__file__).resolve().parents[2]


def conf_dir() -> Path:
    return project_root() / "conf"


def recipes_dir() -> Path:
    return project_root() / "recipes"


def list_options(group: str) -> list[str]:
    """The options of a config group (or `recipe`), sorted."""
    folder = recipes_dir() if group == "recipe" else conf_dir() / group
    return sorted(p.stem for p in folder.glob("*.yaml"))


def recipe_description(name: str) -> str:
    """The recipe's one-line summary: its `description:` key, else its first comment."""
    text = (recipes_dir() / f"{name}.yaml").read_text()
    match = re.search(r"^description:\s*(.+)$", text, re.MULTILINE)
    if match:
        return match.group(1).strip().strip("\"'")
    comments = [line.lstrip("# ").strip() for line in text.splitlines() if line.startswith("#") and "@package" not in line]
    return comments[0] if comments else ""


def _register_schema() -> None:
    ConfigStore.instance().store(name=SCHEMA_NAME, node=structured_schema())


def compose_dictconfig(overrides: list[str]) -> DictConfig:
    """Hydra composition of the primary config with `overrides`; raises ConfigError."""
    _check_group_choices(overrides)
    _register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            return hydra_compose(config_name=PRIMARY, overrides=list(overrides))
    except MissingConfigException as exc:
        raise ConfigError([_missing_option_message(exc)]) from None
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError([_one_line(exc)]) from None
    finally:
        GlobalHydra.instance().clear()


def compose(overrides: list[str]) -> RunConfig:
    """Compose and type-check; the result is a frozen RunConfig (not yet validated).

    The composed tree is merged once more onto a fresh schema so that keys added
    with `+key=value` are checked too; `~key` resets a key to its schema default.
    """
    cfg = compose_dictconfig(overrides)
    try:
        return from_dict(OmegaConf.to_container(cfg, resolve=True))
    except OmegaConfBaseException as exc:
        raise ConfigError([_one_line(exc)]) from None


def _check_group_choices(overrides: list[str]) -> None:
    """Unknown options of a group (or recipe) fail here with the valid list, one line each."""
    problems = []
    for item in overrides:
        key, sep, value = item.lstrip("+").partition("=")
        if sep and key in (*GROUPS, "recipe") and value and value != "null":
            options = list_options(key)
            if value not in options:
                problems.append(f"{key}={value}: unknown {key}; choose one of: {', '.join(options)}")
    if problems:
        raise ConfigError(problems)


def _missing_option_message(exc: MissingConfigException) -> str:
    text = str(exc)
    match = re.search(r"Could not find '([^/']+)/([^']+)'", text)
    if match and match.group(1) in (*GROUPS, "recipe"):
        group, option = match.groups()
        return f"{group}={option}: unknown {group}; choose one of: {', '.join(list_options(group))}"
    return _one_line(exc)


def _one_line(exc: BaseException) -> str:
    """Hydra wraps OmegaConf's error; report the innermost one as `key: reason` on one line."""
    inner = exc
    while inner.__cause__ is not None and isinstance(inner.__cause__, (HydraException, OmegaConfBaseException)):
        inner = inner.__cause__
    lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
    head = lines[0] if lines else type(inner).__name__
    if head.endswith(":") and len(lines) > 1:  # "In 'recipe/x': ValidationError raised while composing config:" + the reason
        head = f"{head} {lines[1]}"
    full_key = getattr(inner, "full_key", None)
    if isinstance(inner, (ConfigAttributeError, ConfigKeyError)) and full_key:
        return f"{full_key}: unknown key; {_valid_keys_hint(full_key)}"
    if full_key:
        return f"{full_key}: {head}"
    if isinstance(inner, OverrideParseException):
        detail = f" ({lines[1]})" if len(lines) > 1 else ""
        return f"{head}{detail}; overrides look like key=value, group=option, +key=value, ~key, key=[a,b]"
    return head


def _valid_keys_hint(full_key: str) -> str:
    parent = full_key.rpartition(".")[0]
    node = structured_schema()
    for part in filter(None, parent.split(".")):
        node = node[part]
    return f"valid keys of {parent or 'the root'}: {', '.join(str(k) for k in node)}"
