"""`CopyingCache`: the one result cache of config/ (compositions, built RunConfigs, the schema template, parsed files).

Separate from the modules that use it so that the three caches share one bounded, copy-on-read policy: each
result is mutable (OmegaConf nodes, lists inside frozen dataclasses), so a caller must never hold the cached
object itself, and none may grow without bound in a long-lived process (a sweep composes thousands of configs).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")
R = TypeVar("R")


class CopyingCache(Generic[V]):
    """A map of at most `max_entries` results, the oldest evicted first; every result handed out is a deep copy.

    Failures are never cached: `build` raising leaves the cache as it was.
    """

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries={max_entries}: a cache holds at least one entry")
        self.max_entries = max_entries
        self._entries: dict[Hashable, V] = {}

    def get_or_build(self, key: Hashable, build: Callable[[], V]) -> V:
        """A copy of the result cached under `key`, building (and caching) it first if there is none."""
        if key not in self._entries:
            self._store(key, build())  # `build`'s own object is never handed out: no copy needed to keep it
        return copy.deepcopy(self._entries[key])

    def read(self, key: Hashable, build: Callable[[], V], reader: Callable[[V], R]) -> R:
        """`reader` applied to the result cached under `key` itself, no copy (built first if there is none): for a
        reader that changes nothing, e.g. OmegaConf.merge, which copies its first config before merging into it."""
        if key not in self._entries:
            self._store(key, build())
        return reader(self._entries[key])

    def put(self, key: Hashable, value: V) -> None:
        """Cache a copy of `value`: the caller may go on changing its own."""
        self._store(key, copy.deepcopy(value))

    def get(self, key: Hashable) -> V | None:
        """A copy of the result under `key`, or None."""
        return copy.deepcopy(self._entries[key]) if key in self._entries else None

    def clear(self) -> None:
        self._entries.clear()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def _store(self, key: Hashable, value: V) -> None:
        while len(self._entries) >= self.max_entries and key not in self._entries:
            self._entries.pop(next(iter(self._entries)))  # dicts keep insertion order: the first is the oldest
        self._entries[key] = value
