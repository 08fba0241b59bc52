"""`trainctl tune`'s probing (trainctl/api/tuning.py) with the launch faked: a refused, a crashed and a hung probe
are recorded as failed and the tune goes on; what a probe wrote is measured; the winner is pinned."""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest

from trainctl import api
from trainctl.api import launching, tuning, watching
from trainctl.core.errors import UserError
from trainctl.plan import tune as planner


@dataclass
class FakePrepared:
    run_dir: Path


class FakeHandle:
    def __init__(self, code: int | None, hangs: bool = False):
        self.exit_code, self.hangs, self.report, self.waits = code, hangs, "", []

    def wait(self, timeout=None):
        self.waits.append(timeout)
        return None if self.hangs else self.exit_code

    @property
    def done(self) -> bool:
        return not self.hangs


def write_metrics(run_dir: Path, speeds: list[float], peak: int) -> None:
    lines = [{"kind": "train", "step": i + 1, "tokens_per_s": s} for i, s in enumerate(speeds)]
    lines.insert(2, {"kind": "memory", "step": 3, "peak_bytes": peak})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


@pytest.fixture
def faked(tmp_path, monkeypatch):
    """Probe 1 refused, 2 crashes, 3 hangs, 4 and 5 run (5 faster); every launch's overrides kept."""
    launched, cancelled = [], []
    outcome = {2: FakeHandle(1), 3: FakeHandle(None, hangs=True), 4: FakeHandle(0), 5: FakeHandle(0)}

    def prepare(overrides, config_dirs=None, *, name="", **_):
        launched.append(list(overrides))
        index = len(launched)
        if index == 1:
            raise UserError(["does not fit: made up"])
        run_dir = tmp_path / "runs" / "tune" / "t" / name
        run_dir.mkdir(parents=True)
        if index in (4, 5):
            write_metrics(run_dir, [1.0, 900.0, 100.0 * index, 100.0 * index, 100.0 * index], 1000 * index)
        return FakePrepared(run_dir)

    monkeypatch.setattr(launching, "prepare_launch", prepare)
    monkeypatch.setattr(launching, "start", lambda prepared, **_: outcome[len(launched)])
    monkeypatch.setattr(watching, "cancel", lambda run_dir: cancelled.append(run_dir))
    monkeypatch.chdir(tmp_path)
    result = tuning.tune(["recipe=tiny_cpu"], top=5, probe_steps=8, probe_timeout_s=7, name="t", repeats=1)
    return result, launched, cancelled, outcome


def test_every_probe_runs_and_failures_are_recorded_with_why(faked):
    result, launched, cancelled, outcome = faked
    assert len(launched) == 5
    by_rank = {p.predicted_rank: p for p in result.probes}
    assert by_rank[1].status == "refused: does not fit: made up"
    assert by_rank[2].status == "failed: exit 1"
    assert by_rank[3].status == "timed out after 7 s" and cancelled == [Path(by_rank[3].run_dir)]
    assert outcome[3].waits == [7, tuning.CANCEL_GRACE_S]
    assert by_rank[4].ok and by_rank[5].ok


def test_probes_are_short_runs_of_the_candidates_layouts(faked):
    _, launched, _, _ = faked
    ranked = planner.rank(api.resolved(["recipe=tiny_cpu"]))
    for overrides, c in zip(launched, ranked, strict=False):
        assert overrides[0] == "recipe=tiny_cpu" and list(c.overrides) == overrides[1:1 + len(c.overrides)]
        assert "train.steps=8" in overrides and "train.eval_every=0" in overrides
        assert "schedule.warmup_steps=4" in overrides  # tiny_cpu's 10, kept below the 8 steps
        assert any(o.startswith("runs_dir=") and o.endswith("tune/t") for o in overrides)


def test_measured_is_the_median_after_the_first_quarter_and_the_busiest_peak(faked):
    result, *_ = faked
    fastest = result.probes[0]
    assert fastest.predicted_rank == 5 and fastest.measured_tokens_per_s == 500.0
    assert fastest.measured_peak_bytes == 5000
    assert fastest.peak_error == pytest.approx(5000 / fastest.predicted_peak_bytes - 1)


def test_the_table_is_sorted_by_measured_speed_failed_last_and_written(faked):
    result, *_ = faked
    assert [p.predicted_rank for p in result.probes[:2]] == [5, 4]
    assert not any(p.ok for p in result.probes[2:])
    data = json.loads((result.folder / tuning.TUNE_JSON).read_text())
    assert data == json.loads(json.dumps(result.to_dict())) and data["winner"] == result.probes[0].label


def test_the_winner_is_pinned_as_a_recipe_that_composes_to_its_layout(faked):
    result, *_ = faked
    winner = planner.rank(api.resolved(["recipe=tiny_cpu"]))[4]
    pinned = api.resolved([f"recipe={result.recipe_file}"])
    assert planner.layout_key(pinned) == planner.layout_key(winner.cfg)
    assert pinned.train.steps == 100 and pinned.recipe == "tiny_cpu_tuned"  # the user's run, not the probe's


def test_merged_drops_what_a_later_list_sets():
    assert tuning.merged(["recipe=r", "runs_dir=a", "train.steps=5"], ["sharding=zero3"], ["runs_dir=b"]) == [
        "recipe=r", "train.steps=5", "sharding=zero3", "runs_dir=b"]


def test_a_bad_top_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="--top 0"):
        tuning.tune(["recipe=tiny_cpu"], top=0)
    assert not (tmp_path / "runs").exists()


def test_a_name_that_is_not_one_folder_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="not a plain directory name"):
        tuning.tune(["recipe=tiny_cpu"], name="a/b")
    assert not (tmp_path / "runs").exists()


def test_collecting_an_unknown_tune_is_one_line(tmp_path):
    from trainctl.api.tuning_queued import collect

    with pytest.raises(UserError, match="--collect nope: no tune of that name"):
        collect("nope", tmp_path)


class InterruptedHandle(FakeHandle):
    """Ctrl-C arrives while the tune waits for this probe."""

    def wait(self, timeout=None):
        self.waits.append(timeout)
        if len(self.waits) == 1:
            raise KeyboardInterrupt
        return 130


def test_ctrl_c_stops_the_running_probe_writes_what_finished_and_pins_nothing(tmp_path, monkeypatch):
    launched, cancelled = [], []
    outcome = {1: FakeHandle(0), 2: InterruptedHandle(None)}

    def prepare(overrides, config_dirs=None, *, name="", **_):
        launched.append(list(overrides))
        run_dir = tmp_path / "runs" / "tune" / "t" / name
        run_dir.mkdir(parents=True)
        write_metrics(run_dir, [1.0, 500.0, 500.0, 500.0], 1000)
        return FakePrepared(run_dir)

    monkeypatch.setattr(launching, "prepare_launch", prepare)
    monkeypatch.setattr(launching, "start", lambda prepared, **_: outcome[len(launched)])
    monkeypatch.setattr(watching, "cancel", lambda run_dir: cancelled.append(run_dir))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(tuning.TuneInterrupted) as info:
        tuning.tune(["recipe=tiny_cpu"], top=4, probe_steps=8, name="t", repeats=1)
    assert len(launched) == 2  # nothing started after the interrupt
    assert cancelled == [tmp_path / "runs" / "tune" / "t" / "probe-02"]  # its own process group: stopped, not left
    assert outcome[2].waits == [tuning.DEFAULT_PROBE_TIMEOUT_S, tuning.CANCEL_GRACE_S]
    written = json.loads((info.value.result.folder / tuning.TUNE_JSON).read_text())
    assert written["interrupted"] is True and written["recipe_file"] is None
    assert [r["status"] for r in written["rows"]] == ["ok", "interrupted", "not run", "not run"]
    assert not list(info.value.result.folder.glob("*.yaml"))


class TerminatedHandle(FakeHandle):
    """SIGTERM (a `kill`, a batch system's stop) arrives while the tune waits for this probe."""

    def wait(self, timeout=None):
        self.waits.append(timeout)
        if len(self.waits) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return 143


def test_sigterm_stops_the_running_probe_like_ctrl_c(tmp_path, monkeypatch):
    launched, cancelled = [], []
    handle = TerminatedHandle(None)

    def prepare(overrides, config_dirs=None, *, name="", **_):
        launched.append(list(overrides))
        run_dir = tmp_path / "runs" / "tune" / "t" / name
        run_dir.mkdir(parents=True)
        return FakePrepared(run_dir)

    monkeypatch.setattr(launching, "prepare_launch", prepare)
    monkeypatch.setattr(launching, "start", lambda prepared, **_: handle)
    monkeypatch.setattr(watching, "cancel", lambda run_dir: cancelled.append(run_dir))
    monkeypatch.chdir(tmp_path)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(tuning.TuneInterrupted) as info:
        tuning.tune(["recipe=tiny_cpu"], top=2, probe_steps=8, name="t")
    assert len(launched) == 1 and cancelled == [tmp_path / "runs" / "tune" / "t" / "probe-01"]
    assert info.value.result.interrupted
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is the tune's only while it probes


@pytest.mark.parametrize("seconds", [0.0, -5.0, float("nan")])
def test_a_probe_timeout_that_is_not_positive_is_one_line(tmp_path, monkeypatch, seconds):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="--probe-timeout .*: give the seconds before a probe counts as hung"):
        tuning.tune(["recipe=tiny_cpu"], probe_timeout_s=seconds, name="t")
    assert not (tmp_path / "runs").exists()
