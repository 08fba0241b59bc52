"""Test tiers by real cost (markers registered in pyproject.toml): `pytest -m unit` is the fast loop.

A test's folder gives its tier unless the test names one itself: tests/unit -> unit, tests/dist -> dist,
tests/slurm -> slurm, tests/fuzz -> fuzz. A test using a fixture that runs programs (stub Slurm clients, a tmpfs
mount) is `cli`; one listed in tests/component_tier.txt (in process, about 0.2 s or more each) is `component`.
A `unit` or `component` test that starts a process or opens a torch process group fails, saying so.

`pytest -m unit` (or `-m component`) runs on up to UNIT_WORKERS processes (pytest-xdist, in the dev extra) where
the machine has the cores: the unit tier is about 1400 in-process tests of a few milliseconds to 0.2 s each, and
two cores halve it. `-n 0` runs it in one process; `-n N` picks N. Every other selection runs in one process
unless it asks for workers (`-n 2 --dist loadgroup`: xdist_group_of keeps a module's shared runs, and the Slurm
cluster, on one worker; tests/longest_first.txt orders the collection so the longest groups start first).
scripts/test.sh runs every tier in one run on two workers, the longest groups first and the in-process tiers last:
one torchrun test alone keeps the two cores about two thirds busy (its programs' start-up and one-process references
run on one core), and the other worker's test takes the rest.
"""

from __future__ import annotations

import gc
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests import process_leaks

TIERS = ("unit", "component", "cli", "dist", "slurm", "fuzz")
IN_PROCESS = ("unit", "component")  # tiers that may start no program and open no process group
FOLDER_TIER = {"unit": "unit", "dist": "dist", "slurm": "slurm", "fuzz": "fuzz"}
# Fixtures that start programs: a test using one is not in-process.
PROCESS_FIXTURES = {"slurm_bin": "cli", "small_fs": "cli"}  # small_fs: mount/umount a tmpfs (test_checkpoint_store)
UNIT_WORKERS = 4
# Session fixtures that set up and tear down something outside the worker (the Slurm cluster: a second worker's
# teardown would stop it under the first). The others (caches, temp folders) are per worker by nature.
ONE_WORKER_SESSION_FIXTURES = {"slurm_cluster"}
# The cases `./scripts/test.sh` leaves to `./scripts/test.sh --full` (marker `extended`): more layouts, schedules,
# optimizers and figures of a proof the default run makes once (the list says which proof covers each).
EXTENDED_TIER = Path(__file__).resolve().parent / "extended_tier.txt"
# The in-process tests that take about 0.2 s or more each (marker `component` instead of `unit`), so that
# `pytest -m unit` stays the fast loop; ./scripts/test.sh runs them beside the unit tier.
COMPONENT_TIER = Path(__file__).resolve().parent / "component_tier.txt"
# The longest groups of tests that start programs (a module sharing its runs, a docs page, the Slurm tests), longest
# first: run on two workers (`--dist loadgroup --no-loadscope-reorder`, as scripts/test.sh does), they start before
# the short ones, so that neither worker is left alone with a long one at the end.
LONGEST_FIRST = Path(__file__).resolve().parent / "longest_first.txt"


def tier_lines(path: Path) -> list[str]:
    """A tier list's node ids (a file, a test function or one case), without comments and blank lines."""
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def is_listed(nodeid: str, lines) -> bool:
    """Whether a list names this test: its file, its function (all of its cases) or exactly this case."""
    function = nodeid.partition("[")[0]
    return any(line in (nodeid, function, nodeid.partition("::")[0]) for line in lines)


def unit_tier_workers(config: pytest.Config) -> int:
    """How many xdist processes a run gets by default: several only for exactly `-m unit` on a machine with the
    cores, with xdist installed, when the user chose nothing (-n, --pdb, --collect-only) and this is not itself a
    worker."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    if ((config.option.markexpr or "").strip() not in IN_PROCESS or hasattr(config, "workerinput")
            or not config.pluginmanager.hasplugin("xdist") or config.option.numprocesses is not None
            or config.option.usepdb or config.option.collectonly):
        return 0
    return min(cores, UNIT_WORKERS) if cores > 1 else 0


@pytest.hookimpl(tryfirst=True)  # before xdist's own (also tryfirst, registered earlier) reads -n
def pytest_cmdline_main(config: pytest.Config) -> None:
    if workers := unit_tier_workers(config):
        config.option.numprocesses = workers


def tier_of(item: pytest.Item) -> str | None:
    """The tier a test gets when it names none itself."""
    for fixture, tier in PROCESS_FIXTURES.items():
        if fixture in getattr(item, "fixturenames", ()):
            return tier
    return FOLDER_TIER.get(item.path.parent.name)


def xdist_group_of(item: pytest.Item) -> str | None:
    """The tests that must share one xdist worker under `--dist loadgroup`: those of a module-scoped fixture (its
    torchrun runs once per worker that needs it: one module, one worker) and those of a project session fixture
    (the Slurm cluster, brought up and down once). Every other test goes to whichever worker is free."""
    info = getattr(item, "_fixtureinfo", None)
    fixtures = [fixture for defs in (info.name2fixturedefs.values() if info is not None else ()) for fixture in defs]
    # The session's group first: a Slurm test that also uses a module fixture must still share the one cluster.
    for fixture in fixtures:
        if fixture.argname in ONE_WORKER_SESSION_FIXTURES:
            return f"session:{fixture.argname}"
    if any(fixture.scope in ("class", "module", "package") for fixture in fixtures):
        return str(item.path)
    return None


def longest_first(items: list[pytest.Item]) -> None:
    """Reorder `items` in place: the groups named in tests/longest_first.txt first, in its order; the rest after,
    as collected. A module's tests stay together (they share its fixtures); only the order changes, never what
    runs."""
    lines = tier_lines(LONGEST_FIRST)

    def rank(item: pytest.Item) -> int:
        return next((i for i, line in enumerate(lines) if is_listed(item.nodeid, (line,))), len(lines))

    items.sort(key=rank)


# First: an xdist worker's own hook (registered after this file, so called before it otherwise) turns each test's
# xdist_group marker into its node id's @group suffix, which is what --dist loadgroup schedules by.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Without pytest-xdist (the GPU image has none) the marker is unknown and --strict-markers refuses it.
    grouped = config.pluginmanager.hasplugin("xdist")
    longest_first(items)
    extended, component = tier_lines(EXTENDED_TIER), tier_lines(COMPONENT_TIER)
    for item in items:
        if is_listed(item.nodeid, extended):
            item.add_marker("extended")
        if is_listed(item.nodeid, component):
            if own := [tier for tier in TIERS if item.get_closest_marker(tier)]:
                raise pytest.UsageError(f"{item.nodeid} is marked {own[0]} and listed in {COMPONENT_TIER.name}: "
                                        "a test has one tier")
            item.add_marker("component")
        if not any(item.get_closest_marker(tier) for tier in TIERS) and (tier := tier_of(item)) is not None:
            item.add_marker(tier)
        if grouped and item.get_closest_marker("unit") is None and (group := xdist_group_of(item)) is not None:
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(autouse=True)
def unit_tests_start_no_process(request, monkeypatch):
    """Keeps the in-process tiers honest: a unit or component test that starts a program fails, naming the marker
    it needs."""
    if not any(request.node.get_closest_marker(tier) for tier in IN_PROCESS):
        return

    def refuse(self, args, *rest, **kwargs):
        raise AssertionError(f"an in-process test started a process ({args!r}): mark it `cli` (or `dist`)")

    def refuse_group(*args, **kwargs):
        raise AssertionError("an in-process test opened a torch process group: mark it `dist`")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    if "torch.distributed" in sys.modules:  # imported by the test's module if it uses it; never imported here
        monkeypatch.setattr(sys.modules["torch.distributed"], "init_process_group", refuse_group)


@pytest.hookimpl(tryfirst=True)
def pytest_collection(session: pytest.Session) -> None:
    """Collection imports torch, transformers and every test module with the garbage collector off (as the worker
    imports torch: trainctl/core/lean_process.py): it frees nothing there, and it cost about 1.5 s of one core per
    collecting process (each xdist worker collects)."""
    gc.disable()


def pytest_collection_finish(session: pytest.Session) -> None:
    gc.enable()


def pytest_configure(config: pytest.Config) -> None:
    process_leaks.mark_session(own=hasattr(config, "workerinput"))
    own_inductor_cache(config)
    cache_bytecode()
    one_thread_per_process()


def one_thread_per_process() -> None:
    """torch runs one intra-op thread in this process and in every program a test starts (OMP_NUM_THREADS=1,
    which the worker and the launch keep), whatever the caller's environment says. Two xdist workers each running
    torch on two threads over two cores do not share them but stall each other: OpenMP's threads wait for each
    other at every kernel's end, and a waiting thread whose peer lost its core spins. Measured on 2 cores: a small
    training loop took 7 CPU-s on one thread beside another such loop, and 160 s on two threads beside another on
    two. One thread per process also keeps a test's in-process reference and a one-rank worker on the same kernels."""
    os.environ["OMP_NUM_THREADS"] = "1"
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


def cache_bytecode() -> None:
    """The suite writes Python's bytecode caches (__pycache__, ignored by git), whatever the caller's
    PYTHONDONTWRITEBYTECODE says: with it, this process recompiles and assertion-rewrites every test module it
    collects, and each of the suite's many programs (CLI runs, torchrun and its workers) recompiles every trainctl
    module it imports, for nothing (about 10 s of each xdist worker's collection on 2 cores, 0.5 s per program)."""
    sys.dont_write_bytecode = False
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def own_inductor_cache(config: pytest.Config) -> None:
    """The session compiles into a fresh Inductor cache folder (inherited by xdist workers and every program a test
    starts), removed at its end, unless the caller named one (TORCHINDUCTOR_CACHE_DIR). What a machine's shared
    /tmp/torchinductor_<user> holds from other runs (another torch, another CPU code path: entries its key cannot
    tell apart, train/inductor_isa.py) cannot reach a test, and the suite proves the cold compile a fresh run pays."""
    if hasattr(config, "workerinput") or os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return
    folder = tempfile.mkdtemp(prefix="trainctl-tests-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))


@pytest.fixture(autouse=True)
def children_get_ctrl_c():
    """Every test starts with SIGINT deliverable to the programs it starts: neither ignored (a suite started in the
    background inherits that, and exec passes an ignored signal on) nor blocked. The Ctrl-C tests' children must
    see their signal whatever ran before them in this process."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a handler: reset to the default in a child
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    yield


@pytest.fixture(autouse=True)
def no_process_outlives_its_test(request):
    """A serial test's leftover processes are killed after a grace period and reported (process_leaks.py)."""
    if any(request.node.get_closest_marker(tier) for tier in IN_PROCESS):
        yield
        return
    before = set(process_leaks.session_processes())
    yield
    left = process_leaks.leftovers(before)
    if left:  # on the test's report, so an xdist worker's leak reaches the controller's summary
        request.node.user_properties.append((LEAK_PROPERTY, left))


LEAK_PROPERTY = "trainctl-leaked-processes"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for name, left in getattr(report, "user_properties", ()):
        if name == LEAK_PROPERTY and report.when == "teardown":
            LEAKS_SEEN.append((report.nodeid, {int(pid): cmd for pid, cmd in left.items()}))


LEAKS_SEEN: list[tuple[str, dict[int, str]]] = []


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    for nodeid, left in LEAKS_SEEN:
        terminalreporter.write_line(f"LEAK {nodeid}: killed {len(left)} process(es) alive "
                                    f"{process_leaks.LEAK_GRACE_S:g} s after it: "
                                    + "; ".join(f"{pid} {cmd[:120]}" for pid, cmd in sorted(left.items())))
