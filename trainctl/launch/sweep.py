"""Sweeps: `trainctl launch -m recipe=tiny_cpu optim.lr=1e-3,3e-4 train.seq_len=256,512`.

Hydra's sweep grammar (comma lists, `range()`, `choice()`, `glob()`) is expanded by Hydra's own basic
sweeper into the cross product of points. Every point is composed, validated, planned and checked as a
single launch would be, before anything is written: one bad point and nothing starts, every bad point
named. Each point then gets an ordinary run directory (`SWEEP-00`, `SWEEP-01`, ...: `runs`, `status`,
`resume`, `export` treat it as any run), and the sweep directory RUNS_DIR/sweeps/SWEEP/sweep.json names
them with their overrides. Locally the points run one after another; on Slurm the sweep is one job array
(launch/backends/slurm/submit.py) whose task i runs point i's own launch script (preemption and requeue as for any run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

from trainctl.config.errors import ConfigError
from trainctl.config.override_shapes import check_override_shapes
from trainctl.config.schema import RunConfig
from trainctl.core import rundir as layout
from trainctl.launch.errors import LaunchError
from trainctl.launch.grid import expand as expand  # callers ask sweep for its grid
from trainctl.launch.rundir import SWEEPS_FOLDER, check_name
from trainctl.plan.runplan import RunPlan

SWEEPS = SWEEPS_FOLDER
SWEEP_FILE = "sweep.json"


@dataclass(frozen=True)
class Point:
    index: int
    overrides: list[str]
    cfg: RunConfig
    plan: RunPlan


def is_sweep(overrides: list[str]) -> list[str]:
    """The overrides that ask for several values (a sweep), as given."""
    check_override_shapes(list(overrides))  # too deep or too long for Hydra's parser: one line, not a RecursionError
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException:
        return []  # not valid overrides at all: composing reports them
    return [o.input_line for o in parsed if o.is_sweep_override()]


def duplicate_problems(points: list[Point]) -> list[str]:
    """Points whose resolved configs are equal (`lr=1e-3,0.001`, a key swept twice): identical, unlabeled runs."""
    seen: dict[str, int] = {}
    problems = []
    for point in points:
        key = repr(dataclasses.asdict(point.cfg))
        if key in seen:
            problems.append(f"-m: point {point.index} ({' '.join(point.overrides)}) is the same run as point "
                            f"{seen[key]}; drop the repeated value")
        else:
            seen[key] = point.index
    return problems


def check_points(points: list[list[str]], build: Callable[[list[str]], tuple[RunConfig, RunPlan, list[str]]]
                 ) -> list[Point]:
    """Every point built and checked by `build` (config, plan, problems); every problem of every point at once."""
    built, problems, bad = [], [], 0
    for index, overrides in enumerate(points):
        head = f"point {index} ({' '.join(overrides)})"
        try:
            cfg, plan, found = build(overrides)
        except (ConfigError, LaunchError) as exc:
            found, cfg = exc.problems, None
        problems += [f"{head}: {p}" for p in found]
        bad += bool(found)
        if cfg is not None and not found:
            built.append(Point(index, overrides, cfg, plan))
    if problems:
        raise LaunchError(problems + [f"nothing was started: {len(points)} points, {bad} with problems"])
    return built


def default_name(cfg: RunConfig) -> str:
    return f"{cfg.recipe or cfg.model.name}-sweep-{time.strftime('%Y%m%d-%H%M%S')}"


def sweep_dir(runs_dir: Path, name: str) -> Path:
    return Path(runs_dir) / SWEEPS / name


def create(points: list[Point], name: str, given: list[str],
           make_run: Callable[[Point, str], Path]) -> Path:
    """The sweep directory and one run directory per point (named NAME-NN); returns the sweep directory.

    Whole or not at all: sweep.json is written last, once every point's run directory exists; an interruption
    (Ctrl-C, SIGTERM, a failure) before that removes what this call created, so no partial sweep looks whole.
    """
    check_name(name)
    runs_dir = Path(points[0].cfg.runs_dir).resolve()
    folder = sweep_dir(runs_dir, name)
    try:
        folder.mkdir(parents=True)
    except FileExistsError:
        raise LaunchError(f"--name {name}: a sweep of that name exists ({folder}); choose another name") from None
    except OSError as exc:
        raise LaunchError(f"runs_dir={runs_dir}: cannot create {folder} ({exc.strerror or exc})") from None
    width = max(2, len(str(len(points) - 1)))
    record = {"name": name, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "overrides": given, "points": []}
    made: list[Path] = []
    try:
        with terminate_as_interrupt():
            for point in points:
                made.append(make_run(point, f"{name}-{point.index:0{width}d}"))
                record["points"].append({"index": point.index, "overrides": point.overrides, "run_dir": str(made[-1])})
            layout.write_json_atomic(folder / SWEEP_FILE, record)
    except BaseException:
        for run_dir in made:
            shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (and SIGHUP) end the block like Ctrl-C does, so its cleanup runs (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def read(runs_dir: Path, name: str) -> dict:
    """A sweep's record, its shape checked; LaunchError (one line) when there is none or it is damaged."""
    folder = sweep_dir(runs_dir, name)
    path = folder / SWEEP_FILE
    if not path.exists():
        known = sorted(p.name for p in (Path(runs_dir) / SWEEPS).glob("*") if (p / SWEEP_FILE).exists())
        raise LaunchError(f"--sweep {name}: no sweep of that name under {Path(runs_dir) / SWEEPS}"
                          + (f"; sweeps there: {', '.join(known)}" if known else ""))
    record = layout.read_json(path)
    problem = _shape_problem(record)
    if problem:
        raise LaunchError(f"--sweep {name}: {path} is damaged ({problem}); its runs are still listed by "
                          "`trainctl runs`")
    return record


def _shape_problem(record: dict) -> str | None:
    """What is wrong with a sweep record's shape, or None (an unreadable file reads as {})."""
    points = record.get("points")
    if not isinstance(points, list):
        return "not a sweep record: no list of points" if record else "not readable JSON"
    for i, p in enumerate(points):
        if not isinstance(p, dict):
            return f"point {i} is not an object"
        if not isinstance(p.get("run_dir"), str) or not p["run_dir"]:
            return f"point {i} has no run_dir path"
        overrides = p.get("overrides", [])
        if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
            return f"point {i}'s overrides are not a list of strings"
    return None


def point_run_dirs(record: dict) -> list[Path]:
    return [Path(p["run_dir"]) for p in record["points"] if isinstance(p, dict) and p.get("run_dir")]


def final_losses(run_dir: Path) -> tuple[float | None, float | None]:
    """(train loss, eval loss) a point ended with: result.json's, else the last logged ones (unfinished runs)."""
    result = layout.result(run_dir) or {}
    train = layout.as_float(result.get("final_train_loss"))
    val = layout.as_float(result.get("final_val_loss"))
    if result:
        return _finite(train), _finite(val)
    records = layout.metrics(run_dir, layout.TAIL_BYTES)
    trains = layout.latest_per_step(records, "train")
    evals = layout.latest_per_step(records, "eval")
    last_train = layout.as_float(trains[-1].get("loss")) if trains else None
    last_val = layout.as_float(evals[-1].get("val_loss")) if evals else None
    return _finite(last_train), _finite(last_val)


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def swept(points: list[list[str]]) -> list[list[str]]:
    """Each point's overrides of the keys that differ between points (what the sweep is about)."""
    values: dict[str, set[str]] = {}
    for overrides in points:
        for item in overrides:
            key, _, value = item.partition("=")
            values.setdefault(key, set()).add(value)
    varying = {key for key, seen in values.items() if len(seen) > 1}
    return [[o for o in overrides if o.partition("=")[0] in varying] for overrides in points]


def ranked(record: dict, states: dict[str, str] | None = None) -> tuple[str, list[dict]]:
    """(the metric ranked by, the points best first): one metric for every point, never train against eval.

    The metric is the final eval loss when every finished point has one, else the final train loss. Points
    that did not finish (`states`: run_dir -> state; anything but COMPLETED) come last, marked, whatever their
    loss: a cancelled point's early loss is not comparable with a finished one's.
    """
    points = [p for p in record["points"] if isinstance(p, dict)]
    states = states or {}
    rows = []
    for p, varied in zip(points, swept([list(p.get("overrides", [])) for p in points]), strict=True):
        run_dir = Path(p.get("run_dir", ""))
        train, val = final_losses(run_dir)
        state = states.get(str(run_dir), "UNKNOWN")
        rows.append({"index": p.get("index"), "overrides": p.get("overrides", []), "swept": varied,
                     "run_dir": str(run_dir), "run": run_dir.name, "state": state, "finished": state == "COMPLETED",
                     "train_loss": train, "val_loss": val})
    finished = [r for r in rows if r["finished"]]
    metric = "val_loss" if finished and all(r["val_loss"] is not None for r in finished) else "train_loss"
    for r in rows:
        r["metric"], r["loss"] = metric, r[metric]
    return metric, sorted(rows, key=lambda r: (not r["finished"], r["loss"] is None,
                                               r["loss"] if r["loss"] is not None else 0.0))
