"""Compose config groups, a recipe and the user's overrides into a typed RunConfig.

Hydra's compose API does the composition and its override grammar (`key=value`,
`group=option`, `+key=value`, `~key`, lists); the structured schema makes unknown
keys and wrong types fail with the key's full path. Every failure becomes a
`ConfigError` whose lines are ready to print.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from hydra import compose as hydra_compose
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    GrammarParseError,
    InterpolationKeyError,
    OmegaConfBaseException,
)

from trainctl.config import interpolations, yaml_files
from trainctl.config.errors import ConfigError, ConfigFileError
from trainctl.config.hydra_source import (
    SCHEMA_NAME,
    config_file,
    include_cycle,
    initialize_catalog,
    own_group_includer,
)
from trainctl.config.load import escape_interpolations, from_dict, structured_schema
from trainctl.config.memo import CopyingCache
from trainctl.config.override_shapes import check_override_shapes
from trainctl.config.schema import GROUPS, RunConfig, cluster_configs
from trainctl.config.sources import (
    ENV_VAR,
    PRIMARY_NAME,
    Catalog,
    SearchPath,
    catalog,
    is_path_like,
    is_plain_name,
    options,
    recipe_file_problem,
    shipped_dir,
)

PRIMARY = PRIMARY_NAME
DEFAULT_PATH = SearchPath()


def project_root() -> Path:
    """The source checkout holding trainctl/, scripts/ and tests/ (meaningless in an installed wheel)."""
    return Path(__file__).resolve().parents[2]


def conf_dir() -> Path:
    """The shipped group folders and config.yaml: the checkout's top-level conf/ (a wheel's trainctl/conf/)."""
    return shipped_dir()


def list_options(group: str, sp: SearchPath = DEFAULT_PATH) -> list[str]:
    """The options of a config group (or `recipe`), sorted; user folders included."""
    return list(options(group, sp))


def recipe_description(name: str, sp: SearchPath = DEFAULT_PATH) -> str:
    """The recipe's one-line summary: its `description:` key, else its first comment (or why it cannot be read)."""
    try:
        text = yaml_files.read_text(options("recipe", sp)[name].path)
    except ConfigError as exc:
        return f"({exc.problems[0]})"
    match = re.search(r"^description:\s*(.+)$", text, re.MULTILINE)
    if match:
        return match.group(1).strip().strip("\"'")
    comments = [line.lstrip("# ").strip() for line in text.splitlines()
                if line.startswith("#") and "@package" not in line]
    return comments[0] if comments else ""


_REGISTERED: dict[str, tuple] = {}  # the registered backends the schema in Hydra's ConfigStore was built for


def _register_schema() -> None:
    """The schema in Hydra's ConfigStore, stored again only when the backends it lists changed (Hydra copies the
    stored node on every load and never changes it; storing it costs a tenth of a composition)."""
    backends, store = tuple(cluster_configs().items()), ConfigStore.instance()
    if _REGISTERED.get("backends") == backends and f"{SCHEMA_NAME}.yaml" in store.repo:
        return
    store.store(name=SCHEMA_NAME, node=structured_schema())
    _REGISTERED["backends"] = backends


# Successful compositions of the group choices (recipe=, model=, ... each with its option) by (those overrides, the
# content of every file they may load, the registered backends): Hydra rebuilds its defaults tree and re-reads
# every file per call (~130 ms); a hit is a deep copy. Content, not stat: a file rewritten within one timestamp tick
# at the same size must still compose afresh. The key=value overrides are applied to that copy afterwards by
# Hydra's own step (what hydra.compose does after the defaults), so a sweep or a test varying values composes its
# groups once. Interpolations (${oc.env:...}) are resolved by the caller after this, so they never come from the
# cache. Failures are not cached.
_COMPOSED: CopyingCache[DictConfig] = CopyingCache(max_entries=64)


def _files_key(cat: Catalog) -> tuple:
    """Each file the composition may load, with a digest of its bytes (None: unreadable, Hydra will say why)."""
    paths = [cat.primary, *(opt.path for group in cat.groups.values() for opt in group.values())]
    digests = []
    for path in paths:
        try:  # bounded, and a FIFO is refused rather than waited on
            digest = hashlib.blake2b(yaml_files.read_text(Path(path), syntax_errors=False).encode(),
                                     digest_size=16).digest()
        except (ConfigFileError, UnicodeDecodeError):
            digest = None
        digests.append((str(path), digest))
    return tuple(digests)


def compose_dictconfig(overrides: list[str], sp: SearchPath = DEFAULT_PATH) -> DictConfig:
    """Hydra composition of the primary config with `overrides` (a fresh copy the caller may change); raises
    ConfigError."""
    check_override_shapes(overrides)
    overrides, sp = _take_recipe_file(list(overrides), sp)
    _check_group_choices(overrides, sp)
    cat = catalog(sp)
    split = _split_overrides(overrides)
    groups, values = split if split is not None else (overrides, [])
    key = (tuple(groups), _files_key(cat), tuple(cluster_configs().items()))
    cfg = _COMPOSED.get_or_build(key, lambda: _hydra_compose(groups, sp, cat))
    if values:
        try:
            ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
        except (HydraException, OmegaConfBaseException) as exc:
            raise ConfigError([_with_user_file(_one_line(exc), sp)]) from None
    return cfg


def _split_overrides(overrides: list[str]) -> tuple[list[str], list[Override]] | None:
    """(the group choices, the parsed key=value overrides) as Hydra itself splits them: an override is a group
    choice when it names a config group and its value is not a dict. None (compose all at once) when one is a
    sweep or does not parse: Hydra's own message is then the answer."""
    groups, values = [], []
    for item in overrides:
        override = _parse(item)
        if override is None or override.is_sweep_override():
            return None
        if override.key_or_group in config_groups() and not isinstance(override.value(), dict):
            groups.append(item)
        else:
            values.append(override)
    return groups, values


def _hydra_compose(overrides: list[str], sp: SearchPath, cat: Catalog) -> DictConfig:
    _register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_catalog(cat):
            return hydra_compose(config_name=PRIMARY, overrides=overrides)
    except ConfigError:
        raise  # a file's own problems, already lines naming it (hydra_source, yaml_files)
    except RecursionError:
        raise ConfigError([_endless_defaults(overrides, sp)]) from None
    except MissingConfigException as exc:
        raise ConfigError([_missing_option_message(exc, sp)]) from None
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError([_with_user_file(_one_line(exc), sp)]) from None
    except ValueError as exc:  # Hydra's own checks of an override's shape, e.g. a group set to a dict
        raise ConfigError([f"{_one_line(exc)}; {_GROUPS_HINT}"]) from None
    finally:
        GlobalHydra.instance().clear()


def compose(overrides: list[str], sp: SearchPath = DEFAULT_PATH) -> RunConfig:
    """Compose and type-check; the result is a frozen RunConfig (not yet validated).

    The composed tree is merged once more onto a fresh schema so that keys added
    with `+key=value` are checked too; `~key` resets a key to its schema default.
    """
    cfg = compose_dictconfig(overrides, sp)
    interpolations.check(OmegaConf.to_container(cfg, resolve=False))
    try:
        # Resolved here, against the composed tree; what is left of `${` is literal text and stays so.
        return from_dict(escape_interpolations(OmegaConf.to_container(cfg, resolve=True)))
    except OmegaConfBaseException as exc:
        raise ConfigError([_one_line(exc)]) from None


def config_groups() -> tuple[str, ...]:
    """The groups whose options are files of the declared config directories (conf/GROUP, recipes/)."""
    return (*GROUPS, "recipe")


_GROUPS_HINT = "see `trainctl recipes` and `trainctl config groups`"


def _take_recipe_file(overrides: list[str], sp: SearchPath) -> tuple[list[str], SearchPath]:
    """`recipe=path/to/foo.yaml` becomes `recipe=foo`, with that file above every config folder."""
    result = []
    for item in overrides:
        override = _parse(item)
        value = override.value() if override is not None and not override.is_sweep_override() else None
        if item.startswith("recipe=") and isinstance(value, str) and is_path_like(value):
            problem = recipe_file_problem(value)
            if problem:
                raise ConfigError([problem])
            path = Path(value).expanduser().resolve()
            if sp.recipe_file is not None and sp.recipe_file != path:
                raise ConfigError([f"{item}: a second recipe file (after recipe={sp.recipe_file}); one run takes one "
                                   "recipe: name one file, and set the rest as key=value overrides"])
            sp = sp.with_recipe_file(path)
            item = f"recipe={path.stem}"
        result.append(item)
    return result, sp


def _parse(item: str):
    try:
        return OverridesParser.create().parse_override(item)
    except (HydraException, ValueError, RecursionError):
        return None  # Hydra reports it (check_override_shapes caught what it would not report in one line)


def _check_group_choices(overrides: list[str], sp: SearchPath) -> None:
    """Refuse, before Hydra composes, any override that would load a config from elsewhere; one line each.

    Hydra resolves an option relative to its group's folder, so `recipe=../x`,
    `+recipe@_global_=../../any/file` or `model=/abs/path` would read any YAML on disk;
    `hydra.searchpath` would add folders. Options must be plain names of the group's files.
    """
    problems = [p for item in overrides if (p := _override_problem(item, sp))]
    if problems:
        raise ConfigError(problems)


def _override_problem(item: str, sp: SearchPath) -> str | None:
    override = _parse(item)
    if override is None:
        return None  # not an override at all; Hydra reports it with the grammar's hint
    key = override.key_or_group
    if key == "hydra" or key.startswith(("hydra.", "hydra/")):
        return (f"{item}: Hydra's own settings (hydra.*) cannot be overridden; "
                f"add config folders with --config-dir DIR or {ENV_VAR}; {_GROUPS_HINT}")
    group = key.split("/")[0]
    if "/" in key and group in config_groups():
        return f"{item}: {group} has no nested groups; choose an option with {group}=NAME; {_GROUPS_HINT}"
    if key not in config_groups():
        return None
    if override.is_sweep_override():
        return f"{item}: one {key} per run; pass {key}=NAME (choose one of: {_choices(list_options(key, sp))})"
    value = override.value()
    options = list_options(key, sp)
    if value is None and not override.is_delete():
        return f"{item}: pass {key}=NAME, or ~{key} for the default; choose one of: {_choices(options)}"
    names = [] if value is None else value if isinstance(value, list) else [value]
    for name in names:
        if not isinstance(name, str) or not is_plain_name(name):
            return (f"{item}: not a {key} name (a file name without .yaml, of letters, digits, _ . -; "
                    f"{key} options load only from config folders: add one with --config-dir DIR); "
                    f"choose one of: {_choices(options)}")
        if name not in options:
            return f"{key}={name}: unknown {key}; choose one of: {_choices(options)}"
    if (override.is_add() or override.is_force_add()) and override.package is None and names:
        # Hydra's own answer is "Multiple values for recipe. To override a value use 'override recipe: x'".
        return f"{item}: {key} is a group the config already has; choose its option with {key}={names[0]}"
    return None


MAX_LISTED = 30  # a config folder may hold thousands of options: the line names the first ones


def _choices(names: list[str]) -> str:
    if len(names) <= MAX_LISTED:
        return ", ".join(names)
    return f"{', '.join(names[:MAX_LISTED])}, ... ({len(names) - MAX_LISTED} more: trainctl config groups)"


def _with_user_file(line: str, sp: SearchPath) -> str:
    """Hydra names a file by its group and option (`In 'model/wide': ...`); a user's file also by its path."""
    match = re.match(r"In '([^/']+)/([^']+)'", line)
    if match:
        opt = options(match.group(1), sp).get(match.group(2))
        if opt is not None and not opt.shipped:
            return f"{opt.path}: {line}"
    return line


def _missing_option_message(exc: MissingConfigException, sp: SearchPath) -> str:
    text = str(exc)
    match = re.search(r"Could not find '([^/']+)/([^']+)'", text)
    if match and match.group(1) in (*GROUPS, "recipe"):
        group, option = match.groups()
        return f"{group}={option}: unknown {group}; choose one of: {_choices(list_options(group, sp))}"
    return _one_line(exc)


def _one_line(exc: BaseException) -> str:
    """Hydra wraps OmegaConf's error; report the innermost one as `key: reason` on one line."""
    inner = exc
    while inner.__cause__ is not None and isinstance(inner.__cause__, (HydraException, OmegaConfBaseException)):
        inner = inner.__cause__
    lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
    head = lines[0] if lines else type(inner).__name__
    # "In 'recipe/x': ValidationError raised while composing config:", then the reason on the next line.
    if head.endswith(":") and len(lines) > 1:
        head = f"{head} {lines[1]}"
    full_key = getattr(inner, "full_key", None)
    if isinstance(inner, (ConfigAttributeError, ConfigKeyError)) and full_key:
        return f"{full_key}: unknown key; {_elsewhere(full_key)}{_valid_keys_hint(full_key)}"
    if isinstance(inner, (InterpolationKeyError, GrammarParseError)):
        head += r"; for a literal '${' in a value write '\${'"
    if full_key:
        return f"{full_key}: {head}"
    if isinstance(inner, OverrideParseException):
        detail = f" ({lines[1]})" if len(lines) > 1 else ""
        return f"{head}{detail}; overrides look like key=value, group=option, +key=value, ~key, key=[a,b]"
    return head


def _elsewhere(full_key: str) -> str:
    """`train.max_restarts`: the one key of that name in another section (`did you mean cluster.max_restarts?`);
    "" when there is none, or several (`precision.name`: the run's name or model.name would be a guess)."""
    leaf = full_key.rsplit(".", 1)[-1]
    found = [key for key in _schema_keys(structured_schema()) if key.rsplit(".", 1)[-1] == leaf and key != full_key]
    return f"did you mean {found[0]}? " if len(found) == 1 else ""


def _schema_keys(node: DictConfig, prefix: str = "") -> list[str]:
    keys = []
    for name in node:
        child = node.get(name)
        keys += _schema_keys(child, f"{prefix}{name}.") if isinstance(child, DictConfig) else [f"{prefix}{name}"]
    return keys


def _valid_keys_hint(full_key: str) -> str:
    """The keys of the deepest section of `full_key` the schema knows (`++zz.a=1 zz.b=2`: zz is not one)."""
    node, known = structured_schema(), []
    for part in full_key.split(".")[:-1]:
        child = node.get(part) if part in node else None
        if not isinstance(child, DictConfig):
            break
        node, known = child, [*known, part]
    return f"valid keys of {'.'.join(known) or 'the root'}: {', '.join(str(k) for k in node) or '(none)'}"


def _endless_defaults(overrides: list[str], sp: SearchPath) -> str:
    """Hydra recursed without end: name the loop of defaults entries, and its first file."""
    cat = catalog(sp)
    chosen = [f"{o.key_or_group}/{o.value()}" for item in overrides if (o := _parse(item)) is not None
              and o.key_or_group in config_groups() and isinstance(o.value(), str)]
    loop = include_cycle(cat, [PRIMARY, *chosen])
    if loop is None:
        own = own_group_includer(cat, [PRIMARY, *chosen])
        if own is not None:
            return (f"{config_file(cat, own)}: its defaults name an option of its own group "
                    f"{own.partition('/')[0]}, which Hydra includes again without end; remove that entry")
        return ("the defaults lists include each other without end (a config that includes its own group or "
                "itself); check the defaults: entries of your recipes and options")
    return (f"{config_file(cat, loop[0])}: its defaults include it again ({' -> '.join(loop)}); "
            "remove the entry that closes the loop")
