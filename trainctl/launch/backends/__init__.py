"""The registry of launcher backends, by `cluster.launcher`; built-ins load on first use.

A third backend is a `Backend` subclass registered with `register`, and its typed config registered with
`config.schema.register_cluster`; nothing else changes (tests/unit/test_backends.py plugs a fake one in).
"""

from __future__ import annotations

import importlib

from trainctl.config.schema import ClusterConfig
from trainctl.launch.backends.base import Backend, Launched
from trainctl.launch.errors import LaunchError

__all__ = ["Backend", "Launched", "for_cluster", "for_record", "named", "register", "unregister"]

BUILTIN_MODULES = ("trainctl.launch.backends.local", "trainctl.launch.backends.slurm")
DEFAULT = "local"  # a run whose record names no backend (never launched, or written before the record said)
_BACKENDS: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    _BACKENDS[backend.name] = backend
    return backend


def unregister(name: str) -> None:
    _BACKENDS.pop(name, None)


def _all() -> dict[str, Backend]:
    for module in BUILTIN_MODULES:
        importlib.import_module(module)
    return _BACKENDS


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
