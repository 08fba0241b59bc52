"""The registry of launcher backends, by `cluster.launcher`: every folder here is one, loaded on first use.

A third backend is a folder launch/backends/<kind>/ whose `__init__` registers a `Backend` subclass with
`register`, plus its typed config registered with `config.schema.register_cluster` and its conf/cluster/<kind>.yaml;
nothing else changes (tests/unit/test_backends.py plugs a fake one in).
"""

from __future__ import annotations

import importlib
import pkgutil

from trainctl.config.schema import ClusterConfig
from trainctl.launch.backends.base import Backend, Launched, State
from trainctl.launch.errors import LaunchError

__all__ = ["Backend", "Launched", "State", "every", "for_cluster", "for_record", "named", "register", "unregister"]

# A run whose record names no backend (never launched, or written before the record said): the default cluster's.
DEFAULT = ClusterConfig.NAME
_BACKENDS: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    _BACKENDS[backend.name] = backend
    return backend


def unregister(name: str) -> None:
    _BACKENDS.pop(name, None)


def _all() -> dict[str, Backend]:
    # Each backend's folder registers itself on import; importing one twice is free.
    for folder in pkgutil.iter_modules(__path__):
        if folder.ispkg:
            importlib.import_module(f"{__name__}.{folder.name}")
    return _BACKENDS


def every() -> list[Backend]:
    """All known backends."""
    return list(_all().values())


def named(name: str) -> Backend:
    backends = _all()
    if name not in backends:
        raise LaunchError(f"cluster.launcher={name!r}: no such launcher backend; use one of: {', '.join(backends)}")
    return backends[name]


def for_cluster(cluster: ClusterConfig) -> Backend:
    return named(cluster.launcher)


def for_record(record: dict) -> Backend:
    """The backend a run's launch.json names; the default one for a run never launched (or unknown here)."""
    name = record.get("launcher")
    backends = _all()
    return backends.get(name, backends[DEFAULT]) if isinstance(name, str) else backends[DEFAULT]
