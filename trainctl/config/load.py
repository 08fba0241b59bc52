"""Reading configs in and writing them out: mappings and run directories' config.yaml to RunConfig, and back.

schema.py declares the keys and their types; this module holds what turns data into those dataclasses through
OmegaConf (the structured schema node, `from_dict`, `load_run_config`) and what writes one out (`to_yaml`).
It is separate so that the schema stays a plain declaration, and the OmegaConf machinery, its caches and the
upgrade path for older run directories live in one place. Imported on both sides of the wall: no torch.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import typing
from dataclasses import asdict, fields, replace
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from trainctl.config.errors import ConfigError
from trainctl.config.memo import CopyingCache
from trainctl.config.schema import ClusterConfig, RunConfig, cluster_configs


def to_yaml(cfg: RunConfig) -> str:
    """The config as YAML, in schema order; `load_run_config` reads every string back exactly.

    OmegaConf resolves `${...}` in string values when the file is loaded, so a literal one is
    written escaped (see `escape_interpolations`). Not through `OmegaConf.structured(cfg)`: it
    parses every string as it builds the nodes and fails on a literal, unbalanced `${`.
    """
    return OmegaConf.to_yaml(OmegaConf.create(escape_interpolations(asdict(cfg))))


_INTERPOLATION_START = re.compile(r"(\\*)\$\{")


def escape_string(value: str) -> str:
    """`value` written so that OmegaConf reads it back as itself, interpolations included.

    OmegaConf reads `\\${` as a literal `${` and halves a run of backslashes right before `${`
    (2k+1 of them: k backslashes and a literal `${`); backslashes elsewhere are literal.
    """
    return _INTERPOLATION_START.sub(lambda m: m.group(1) * 2 + "\\${", value)


def escape_interpolations(data):
    """Every string of a plain container (dicts, lists) through `escape_string`; keys are never resolved."""
    if isinstance(data, str):
        return escape_string(data)
    if isinstance(data, dict):
        return {key: escape_interpolations(value) for key, value in data.items()}
    if isinstance(data, list):
        return [escape_interpolations(item) for item in data]
    return data


def _unfreeze(node) -> None:
    # Frozen dataclasses give read-only nodes; merging YAML onto them needs write access.
    OmegaConf.set_readonly(node, None)
    if OmegaConf.is_dict(node):
        for key in node:
            _unfreeze(node._get_node(key))


# The built schema of the current set of registered backends: building it costs ~20 ms (twice per compose), a
# deep copy ~2 ms. One entry: a newly registered backend replaces the template of the set before it.
_SCHEMA_TEMPLATES: CopyingCache[DictConfig] = CopyingCache(max_entries=1)


def structured_schema() -> DictConfig:
    """The schema as a typed, writable OmegaConf node (struct mode: unknown keys fail).

    `cluster` holds the keys of every registered backend, each typed, so that composing checks them all
    (`cluster=local cluster.partition=x` reaches `from_dict`, which names the backend that has the key).
    A fresh deep copy of a cached template: callers merge into it, so no compose sees another's values; a backend
    registered later (a plugin, a test's fake) gives a new key and so a new template.
    """
    clusters = cluster_configs()
    return _SCHEMA_TEMPLATES.get_or_build(tuple(clusters.items()), lambda: _build_schema(clusters))


def _build_schema(clusters: dict[str, type[ClusterConfig]]) -> DictConfig:
    node = OmegaConf.structured(RunConfig)
    _unfreeze(node)
    OmegaConf.set_struct(node.cluster, False)
    for cls in clusters.values():
        typed = OmegaConf.structured(cls)
        _unfreeze(typed)
        for key in typed:
            if key not in node.cluster:
                node.cluster[key] = typed._get_node(key)
    _unfreeze(node.cluster)  # a frozen dataclass's node comes back read-only when it is added
    OmegaConf.set_struct(node.cluster, True)
    # A user-named map: `cluster.env.NAME=value` adds a key instead of failing as unknown.
    for key in _USER_MAPS:
        if key in node.cluster:
            OmegaConf.set_struct(node.cluster[key], False)
    return node


_USER_MAPS = ("env",)  # cluster keys whose entries the user names


# RunConfigs built from plain mappings, by the mapping's typed canonical form (1, 1.0, "1" and True stay apart),
# `strict` and the registered backends: OmegaConf's typed merge costs ~100 ms; a hit is a deep copy of frozen
# dataclasses. Failures are not cached.
_FROM_DICT: CopyingCache[RunConfig] = CopyingCache(max_entries=128)


def from_dict(data: dict | DictConfig, strict: bool = True) -> RunConfig:
    """Type-check a mapping against the schema and build a frozen RunConfig, its cluster the backend's class.

    `strict`: a key of another backend, set to anything but its default, is an error (a ConfigError naming
    the backend that has it); otherwise it is dropped (a run directory written before the split).
    """
    if not isinstance(data, dict):
        return _from_dict(data, strict)
    key = (_canonical(data), strict, tuple(cluster_configs().items()))
    return _FROM_DICT.get_or_build(key, lambda: _from_dict(data, strict))


def _canonical(value):
    """A hashable form of a plain mapping in which values of different types never meet (1, 1.0, "1", True)."""
    if isinstance(value, dict):
        return ("dict", tuple(sorted(((type(k).__name__, repr(k)), _canonical(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_canonical(v) for v in value))
    return (type(value).__name__, repr(value))


def typed_merge(data: dict | DictConfig) -> tuple[DictConfig, dict]:
    """(`data` merged onto the schema: a typed node of its own, the schema's cluster defaults). OmegaConf.merge
    deep-copies its first config before merging into it, so the cached template is read, never changed, and not
    copied twice (a copy is about a fifth of the merge)."""
    clusters = cluster_configs()
    return _SCHEMA_TEMPLATES.read(
        tuple(clusters.items()), lambda: _build_schema(clusters),
        lambda schema: (OmegaConf.merge(schema, data), OmegaConf.to_container(schema.cluster)))


def _from_dict(data: dict | DictConfig, strict: bool) -> RunConfig:
    merged, cluster_defaults = typed_merge(data)
    cluster = cluster_from_dict(OmegaConf.to_container(merged.cluster), cluster_defaults, strict)
    merged.cluster = ClusterConfig()  # the base, replaced below (to_object cannot build the union of keys)
    cfg = replace(OmegaConf.to_object(merged), cluster=cluster)
    problems = nested_value_problems(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg


def nested_value_problems(node, prefix: str = "") -> list[str]:
    """A list or mapping where a list[str]/list[int]/list[float]/dict[str, str] field wants a scalar: one line each.

    OmegaConf's typed lists and dicts check scalars (None, a word in an int list) but let a nested list or
    mapping through (`data.datasets=[[]]`, `cluster.env={A:[1]}`), which would reach a path, a shell line or
    a sum as Python's repr.
    """
    problems = []
    for name, scalar in _container_fields(type(node)):
        key, value = f"{prefix}.{name}" if prefix else name, getattr(node, name)
        if scalar is None:
            problems += nested_value_problems(value, key)
            continue
        is_list = isinstance(value, list)
        shape = f"{key}=[a,b]" if is_list else f"{key}={{NAME:value}}"
        for index, item in enumerate(value) if is_list else value.items():
            if isinstance(item, (list, dict, tuple)):
                where = f"{key}[{index}]" if is_list else f"{key}.{index}"
                problems.append(f"{where}={item!r}: a {type(item).__name__} where one {scalar.__name__} goes; "
                                f"write {shape} with plain values")
    return problems


@functools.cache
def _container_fields(cls: type) -> tuple[tuple[str, type | None], ...]:
    """(name, the element type) of each list/dict-of-scalars field; (name, None) for a nested config."""
    out, hints = [], typing.get_type_hints(cls)
    for f in fields(cls):
        hint = hints.get(f.name)
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            out.append((f.name, None))
        elif typing.get_origin(hint) in (list, dict):
            element = typing.get_args(hint)[-1]
            if element in (str, int, float, bool):
                out.append((f.name, element))
    return tuple(out)


def cluster_from_dict(values: dict, defaults: dict, strict: bool = True) -> ClusterConfig:
    """The typed config of the backend `values["launcher"]` names; raises ConfigError for what it lacks."""
    from trainctl.config.errors import ConfigError

    classes = cluster_configs()
    cls = classes.get(values["launcher"])
    if cls is None:
        raise ConfigError([f"cluster.launcher={values['launcher']!r}: not a valid choice; "
                           f"use one of: {', '.join(classes)}"])
    own = {f.name for f in fields(cls)}
    foreign = [key for key in values if key not in own and values[key] != defaults.get(key)]
    if foreign and strict:
        raise ConfigError([_foreign_key_line(key, values[key], cls, classes) for key in foreign])
    typed = OmegaConf.structured(cls)
    _unfreeze(typed)
    return OmegaConf.to_object(OmegaConf.merge(typed, {key: value for key, value in values.items() if key in own}))


def _foreign_key_line(key: str, value, cls: type[ClusterConfig], classes: dict) -> str:
    owners = [name for name, c in classes.items() if key in {f.name for f in fields(c)}]
    where = f"a key of {' and '.join(f'cluster={o}' for o in owners)}" if owners else "not a cluster key"
    choose = f"choose cluster={owners[0]}, or drop it" if owners else "drop it"
    return f"cluster.{key}={value!r}: cluster={cls.NAME} has no such key ({where}); {choose}"


# Keys that config.yaml files of older runs hold but the schema no longer has. Each group once had a `name`
# next to the key that names its option, and guards had a test-only NaN injection (tests now inject faults
# from their own code); a run directory written then must still resume, so these are dropped when a run's
# file is read (never in compose: a user's `sharding.name=x` is an unknown key).
RETIRED_KEYS = {"precision": ("name",), "sharding": ("name",), "cluster": ("name",), "data": ("name",),
                "guards": ("inject_nan_step",)}


def _drop_retired_keys(data: DictConfig) -> DictConfig:
    for group, keys in RETIRED_KEYS.items():
        node = data.get(group) if OmegaConf.is_dict(data) else None
        if OmegaConf.is_dict(node):
            for key in keys:
                node.pop(key, None)
    return data


def load_run_config(path: str | Path) -> RunConfig:
    """Read a run directory's `config.yaml` (or the file itself) into a RunConfig.

    Read with yaml_files' bounds (a regular file, its size, its aliases and interpolations): past them, a
    ConfigFileError (also a ValueError) whose one line leaves naming the file to the caller, never a hang.
    Syntax errors and wrong keys or types raise PyYAML's and OmegaConf's own errors, as they always did.
    """
    from trainctl.config import interpolations, yaml_files
    from trainctl.config.errors import ConfigError, ConfigFileError
    from trainctl.core import rundir

    path = Path(path)
    if path.is_dir():
        path = path / rundir.CONFIG
    data = yaml_files.load(path, name="", syntax_errors=False)
    if not isinstance(data, dict):
        raise ConfigFileError([f"not a mapping of config keys (it holds {type(data).__name__}); a run's "
                               f"{rundir.CONFIG} is written by trainctl: restore it or launch a new run"])
    try:
        interpolations.check(data)
    except ConfigError as exc:
        raise ConfigFileError(exc.problems) from None
    return from_dict(_drop_retired_keys(OmegaConf.create(data)), strict=False)
