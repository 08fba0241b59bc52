"""Test tiers by real cost (markers registered in pyproject.toml): `pytest -m unit` is the fast loop.

A test's folder gives its tier unless the test names one itself: tests/unit -> unit, tests/dist -> dist,
tests/slurm -> slurm, tests/fuzz -> fuzz. A test using a fixture that runs programs (stub Slurm clients, a tmpfs
mount) is `cli`.
A `unit` test that starts a process or opens a torch process group fails, saying so.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

TIERS = ("unit", "cli", "dist", "slurm", "fuzz")
FOLDER_TIER = {"unit": "unit", "dist": "dist", "slurm": "slurm", "fuzz": "fuzz"}
# Fixtures that start programs: a test using one is not in-process.
PROCESS_FIXTURES = {"slurm_bin": "cli", "small_fs": "cli"}  # small_fs: mount/umount a tmpfs (test_checkpoint_store)


def tier_of(item: pytest.Item) -> str | None:
    """The tier a test gets when it names none itself."""
    for fixture, tier in PROCESS_FIXTURES.items():
        if fixture in getattr(item, "fixturenames", ()):
            return tier
    return FOLDER_TIER.get(item.path.parent.name)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if any(item.get_closest_marker(tier) for tier in TIERS):
            continue
        tier = tier_of(item)
        if tier is not None:
            item.add_marker(tier)


@pytest.fixture(autouse=True)
def unit_tests_start_no_process(request, monkeypatch):
    """Keeps the unit tier honest: a unit test that starts a program fails, naming the marker it needs."""
    if request.node.get_closest_marker("unit") is None:
        return

    def refuse(self, args, *rest, **kwargs):
        raise AssertionError(f"a `unit` test started a process ({args!r}): mark it `cli` (or `dist`)")

    def refuse_group(*args, **kwargs):
        raise AssertionError("a `unit` test opened a torch process group: mark it `dist`")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    if "torch.distributed" in sys.modules:  # imported by the test's module if it uses it; never imported here
        monkeypatch.setattr(sys.modules["torch.distributed"], "init_process_group", refuse_group)
