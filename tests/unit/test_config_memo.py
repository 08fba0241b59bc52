"""CopyingCache (config/memo.py): bounded, oldest out first, and no caller ever holds the cached object."""

from __future__ import annotations

import pytest

from trainctl.config.memo import CopyingCache


def test_a_result_handed_out_is_a_copy():
    cache: CopyingCache[dict] = CopyingCache(max_entries=2)
    first = cache.get_or_build("k", lambda: {"tags": ["a"]})
    first["tags"].append("leaked")
    assert cache.get_or_build("k", lambda: {"tags": ["rebuilt"]}) == {"tags": ["a"]}  # cached, and unchanged
    assert cache.get("k") == {"tags": ["a"]} and cache.get("missing") is None


def test_put_keeps_a_copy_of_the_callers_value():
    cache: CopyingCache[list] = CopyingCache(max_entries=2)
    mine = [1]
    cache.put("k", mine)
    mine.append(2)
    assert cache.get("k") == [1]


def test_the_oldest_entry_is_evicted_first():
    cache: CopyingCache[int] = CopyingCache(max_entries=2)
    for key in ("a", "b", "c"):
        cache.get_or_build(key, lambda key=key: ord(key))
    assert "a" not in cache and "b" in cache and "c" in cache and len(cache) == 2
    cache.put("b", 0)  # replacing an entry evicts nothing
    assert len(cache) == 2 and cache.get("c") == ord("c")


def test_a_failed_build_caches_nothing():
    cache: CopyingCache[int] = CopyingCache(max_entries=1)
    cache.get_or_build("old", lambda: 1)

    def fail() -> int:
        raise ValueError("no")

    with pytest.raises(ValueError):
        cache.get_or_build("new", fail)
    assert "new" not in cache and cache.get("old") == 1


def test_a_cache_holds_at_least_one_entry():
    with pytest.raises(ValueError, match="max_entries=0"):
        CopyingCache(max_entries=0)


def test_read_hands_the_cached_object_to_a_reader_and_builds_once():
    cache: CopyingCache[list] = CopyingCache(max_entries=1)
    built = []
    assert cache.read("k", lambda: built.append(1) or [3, 4], sum) == 7
    assert cache.read("k", lambda: built.append(1) or [0], len) == 2 and built == [1]
