"""Run records and sweeps against hostile files (issue 21): no reader opens a FIFO or reads without a bound, a
damaged sweep.json is named, a sweep ranks by one metric and is created whole or not at all."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from trainctl.config import compose as composer
from trainctl.config.errors import ConfigError
from trainctl.config.schema import RunConfig
from trainctl.config.validate import resolve
from trainctl.core import rundir as layout
from trainctl.core import trainer_lock
from trainctl.launch import sweep
from trainctl.launch.errors import LaunchError
from trainctl.launch.rundir import check_name
from trainctl.runs import plot

DEADLINE_S = 10


def within_deadline(fn):
    """fn() run in a thread: its value, or a failure (not a hung test) when it blocks past the deadline."""
    box: dict = {}
    thread = threading.Thread(target=lambda: box.setdefault("value", fn()), daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    assert not thread.is_alive(), f"{fn} blocked for {DEADLINE_S} s (a FIFO opened for reading?)"
    return box["value"]


@pytest.fixture
def fifo_run(tmp_path):
    """A run directory whose every record is a FIFO nobody writes."""
    for name in (layout.CONFIG, layout.METRICS, layout.RESULT, layout.LAUNCH, layout.HOLDER, layout.STOPPED,
                 layout.LOCK):
        os.mkfifo(tmp_path / name)
    return tmp_path


def test_readers_never_block_on_a_fifo(fifo_run):
    assert within_deadline(lambda: layout.read_json(fifo_run / layout.LAUNCH)) == {}
    assert within_deadline(lambda: layout.read_jsonl(fifo_run / layout.METRICS)) == []
    assert within_deadline(lambda: layout.configured_steps(fifo_run)) is None
    assert within_deadline(lambda: layout.result(fifo_run)) is None
    assert within_deadline(lambda: trainer_lock.lock_holder(fifo_run)) is None
    assert within_deadline(lambda: layout.open_regular(fifo_run / layout.RESULT)) is None


def test_a_fifo_lock_is_refused_not_waited_on(fifo_run):
    def try_acquire():
        try:
            trainer_lock.acquire(fifo_run)
        except trainer_lock.LockHeld as exc:
            return str(exc)
        return "acquired"

    assert "not a regular file" in within_deadline(try_acquire)


def test_an_overlong_metrics_line_is_skipped_and_the_next_one_read(tmp_path):
    path = tmp_path / layout.METRICS
    with open(path, "w") as f:
        f.write(json.dumps({"kind": "train", "step": 1, "pad": "x" * (layout.MAX_LINE_BYTES + 10)}) + "\n")
        f.write(json.dumps({"kind": "train", "step": 2}) + "\n")
    assert [r["step"] for r in layout.read_jsonl(path)] == [2]


def test_a_json_record_past_the_bound_reads_as_absent(tmp_path, monkeypatch):
    path = tmp_path / layout.RESULT
    path.write_text(json.dumps({"state": "COMPLETED", "pad": "x" * 200}))
    assert layout.read_json(path)["state"] == "COMPLETED"
    monkeypatch.setattr(layout, "MAX_JSON_BYTES", 100)
    assert layout.read_json(path) == {}


def test_a_nested_json_bomb_reads_as_absent(tmp_path):
    path = tmp_path / layout.RESULT
    path.write_text("[" * 100_000 + "]" * 100_000)
    assert layout.read_json(path) == {}


# ---------------------------------------------------------------- sweeps


def test_a_sweep_without_points_is_refused():
    with pytest.raises(ConfigError, match="no points"):
        sweep.expand(["train.seed=range(0,0)"])


def _point(index: int, overrides: list[str]) -> sweep.Point:
    cfg = composer.compose(["recipe=tiny_cpu", *overrides])
    return sweep.Point(index, overrides, cfg, None)


def test_points_that_are_the_same_run_are_refused():
    points = [_point(0, ["optim.lr=1e-3"]), _point(1, ["optim.lr=0.001"]), _point(2, ["optim.lr=2e-3"])]
    problems = sweep.duplicate_problems(points)
    assert len(problems) == 1 and "point 1" in problems[0] and "point 0" in problems[0]


@pytest.mark.parametrize("record", [
    "not json", {"points": "abc"}, {"points": [3]}, {"points": [{"run_dir": 7}]},
    {"points": [{"run_dir": "x", "overrides": "a=1"}]}, {"points": [{"run_dir": "x", "overrides": [1]}]},
])
def test_a_damaged_sweep_record_is_named(tmp_path, record):
    folder = sweep.sweep_dir(tmp_path, "sw")
    folder.mkdir(parents=True)
    (folder / sweep.SWEEP_FILE).write_text(record if isinstance(record, str) else json.dumps(record))
    with pytest.raises(LaunchError, match="sweep.json is damaged"):
        sweep.read(tmp_path, "sw")


def _finished(run_dir: Path, train: float, val: float | None) -> None:
    run_dir.mkdir(parents=True)
    layout.write_json_atomic(run_dir / layout.RESULT, {"state": "COMPLETED", "final_train_loss": train,
                                                       "final_val_loss": val})


def test_an_unfinished_point_ranks_last_whatever_its_loss(tmp_path):
    a, b, c = (tmp_path / n for n in ("sw-00", "sw-01", "sw-02"))
    _finished(a, 1.2, 1.5)
    _finished(b, 1.1, 1.3)
    c.mkdir()
    with open(c / layout.METRICS, "w") as f:
        f.write(json.dumps({"kind": "train", "step": 1, "loss": 0.5}) + "\n")
    record = {"points": [{"index": i, "overrides": [f"optim.lr={i}"], "run_dir": str(d)} for i, d in
                         enumerate((a, b, c))]}
    states = {str(a): "COMPLETED", str(b): "COMPLETED", str(c): "CANCELLED"}
    metric, rows = sweep.ranked(record, states)
    assert metric == "val_loss"
    assert [r["run"] for r in rows] == ["sw-01", "sw-00", "sw-02"]
    assert not rows[-1]["finished"]


def test_a_sweep_interrupted_while_its_runs_are_written_leaves_nothing(tmp_path):
    cfg = RunConfig(runs_dir=str(tmp_path))
    points = [sweep.Point(i, [f"train.seed={i}"], cfg, None) for i in range(3)]
    made = []

    def make_run(point, name):
        if point.index == 2:
            raise KeyboardInterrupt
        run_dir = tmp_path / name
        run_dir.mkdir()
        made.append(run_dir)
        return run_dir

    with pytest.raises(KeyboardInterrupt):
        sweep.create(points, "sw", [], make_run)
    assert len(made) == 2 and not any(d.exists() for d in made)
    assert not sweep.sweep_dir(tmp_path, "sw").exists()


def test_sweeps_is_not_a_run_name():
    with pytest.raises(LaunchError, match="sweeps"):
        check_name("sweeps")


# ---------------------------------------------------------------- runs folder and plot target


@pytest.mark.parametrize("given", ["", "  "])
def test_a_blank_runs_dir_is_the_default(given):
    cfg = composer.compose(["recipe=tiny_cpu", f"runs_dir='{given}'"])
    assert resolve(cfg).runs_dir == "runs"


def test_plot_target_names_a_file(tmp_path):
    (tmp_path / "pics").mkdir()
    assert plot.target_path(tmp_path / "pics") == tmp_path / "pics" / "plot.png"
    assert plot.target_path(tmp_path / "curves.svg") == tmp_path / "curves.svg"
    with pytest.raises(LaunchError, match="not an image file name"):
        plot.target_path(tmp_path / "curves.txt")
    (tmp_path / "f").write_text("mine")
    with pytest.raises(LaunchError, match="is a file, not a folder"):
        plot.target_path(tmp_path / "f" / "plot.png")
    assert (tmp_path / "f").read_text() == "mine"
