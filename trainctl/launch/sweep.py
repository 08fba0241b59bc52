"""Sweeps: `trainctl launch -m recipe=tiny_cpu optim.lr=1e-3,3e-4 train.seq_len=256,512`.

Hydra's sweep grammar (comma lists, `range()`, `choice()`, `glob()`) is expanded by Hydra's own basic
sweeper into the cross product of points. Every point is composed, validated, planned and checked as a
single launch would be, before anything is written: one bad point and nothing starts, every bad point
named. Each point then gets an ordinary run directory (`SWEEP-00`, `SWEEP-01`, ...: `runs`, `status`,
`resume`, `export` treat it as any run), and the sweep directory RUNS_DIR/sweeps/SWEEP/sweep.json names
them with their overrides. Locally the points run one after another; on Slurm the sweep is one job array
(launch/slurm.py) whose task i runs point i's own launch script (preemption and requeue as for any run).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

from trainctl.config.errors import ConfigError
from trainctl.config.schema import RunConfig
from trainctl.core import rundir as layout
from trainctl.launch.errors import LaunchError
from trainctl.launch.rundir import check_name
from trainctl.plan.runplan import RunPlan

SWEEPS = "sweeps"
SWEEP_FILE = "sweep.json"


@dataclass(frozen=True)
class Point:
    index: int
    overrides: list[str]
    cfg: RunConfig
    plan: RunPlan


def is_sweep(overrides: list[str]) -> list[str]:
    """The overrides that ask for several values (a sweep), as given."""
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException:
        return []  # not valid overrides at all: composing reports them
    return [o.input_line for o in parsed if o.is_sweep_override()]


def expand(overrides: list[str]) -> list[list[str]]:
    """The sweep's points, each a list of plain overrides (the cross product, in the order given)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
        (batch,) = BasicSweeper.split_arguments(parsed, None)
    except HydraException as exc:
        text = str(exc).splitlines()[0]
        if "does not support sweep type" in text:
            text = ("interval() needs a sampling sweeper (Optuna, Nevergrad); a grid sweep takes lists "
                    "(a=1,2,3), range(start,stop,step) or choice(a,b)")
        raise ConfigError([f"-m: {text}"]) from None
    return [list(point) for point in batch]


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
    """The sweep directory and one run directory per point (named NAME-NN); returns the sweep directory."""
    check_name(name)
    runs_dir = Path(points[0].cfg.runs_dir).resolve()
    folder = sweep_dir(runs_dir, name)
    try:
        folder.mkdir(parents=True)
    except FileExistsError:
        raise LaunchError(f"--name {name}: a sweep of that name exists ({folder}); choose another name") from None
    width = max(2, len(str(len(points) - 1)))
    record = {"name": name, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "overrides": given, "points": []}
    for point in points:
        run_dir = make_run(point, f"{name}-{point.index:0{width}d}")
        record["points"].append({"index": point.index, "overrides": point.overrides, "run_dir": str(run_dir)})
        layout.write_json_atomic(folder / SWEEP_FILE, record)  # after each: a failure mid-way still names them
    return folder


def read(runs_dir: Path, name: str) -> dict:
    """A sweep's record; LaunchError (one line) when there is none."""
    folder = sweep_dir(runs_dir, name)
    record = layout.read_json(folder / SWEEP_FILE)
    if not isinstance(record.get("points"), list):
        known = sorted(p.name for p in (Path(runs_dir) / SWEEPS).glob("*") if (p / SWEEP_FILE).is_file())
        raise LaunchError(f"--sweep {name}: no sweep of that name under {Path(runs_dir) / SWEEPS}"
                          + (f"; sweeps there: {', '.join(known)}" if known else ""))
    return record


def point_run_dirs(record: dict) -> list[Path]:
    return [Path(p["run_dir"]) for p in record["points"] if isinstance(p, dict) and p.get("run_dir")]


def final_loss(run_dir: Path) -> float | None:
    """What ranks a point: the final eval loss, else the last train loss."""
    result = layout.result(run_dir) or {}
    for key in ("final_val_loss", "final_train_loss"):
        value = layout.as_float(result.get(key))
        if value is not None:
            return value
    return layout.as_float(layout.last_train_record(run_dir).get("loss"))


def swept(points: list[list[str]]) -> list[list[str]]:
    """Each point's overrides of the keys that differ between points (what the sweep is about)."""
    values: dict[str, set[str]] = {}
    for overrides in points:
        for item in overrides:
            key, _, value = item.partition("=")
            values.setdefault(key, set()).add(value)
    varying = {key for key, seen in values.items() if len(seen) > 1}
    return [[o for o in overrides if o.partition("=")[0] in varying] for overrides in points]


def ranked(record: dict) -> list[dict]:
    """The points with their run and final loss, best (lowest) first; points without a loss last."""
    points = [p for p in record["points"] if isinstance(p, dict)]
    rows = []
    for p, varied in zip(points, swept([list(p.get("overrides", [])) for p in points]), strict=True):
        run_dir = Path(p.get("run_dir", ""))
        rows.append({"index": p.get("index"), "overrides": p.get("overrides", []), "swept": varied,
                     "run_dir": str(run_dir), "run": run_dir.name, "loss": final_loss(run_dir)})
    return sorted(rows, key=lambda r: (r["loss"] is None, r["loss"] if r["loss"] is not None else 0.0))
