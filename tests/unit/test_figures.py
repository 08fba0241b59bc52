"""`trainctl runs` / `status`: a run's measured MFU and peak memory next to its plan's figures."""

from __future__ import annotations

import dataclasses
import json

import pytest
from test_runs import cli

from tests.helpers import make_run
from trainctl.runs.figures import Figures, figures

GIB = 2**30


def write_figures(run_dir, device="cuda", train_mfus=(0.30, 0.36, 0.38, 0.37)) -> None:
    plan = {"device": device, "assumed_mfu": 0.4, "memory": {"peak_bytes": int(60.3 * GIB)}}
    (run_dir / "plan.json").write_text(json.dumps(plan))
    lines = [{"kind": "eval", "step": 0, "val_loss": 5.0}, {"kind": "memory", "step": 3, "peak_bytes": int(61.2 * GIB),
             "peak_source": "cuda_max_memory_allocated", "per_rank": []}]
    lines += [{"kind": "train", "step": 10 * (i + 1), "loss": 3.0, "mfu": m} for i, m in enumerate(train_mfus)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_figures_read_the_memory_record_and_the_recent_mfu(tmp_path):
    run_dir = make_run(tmp_path / "runs", "a", launch={"launcher": "local", "exit_code": 0})
    write_figures(run_dir)
    f = figures(run_dir)
    assert f.mfu == (0.36 + 0.37) / 2  # the median of the train records
    assert (f.plan_mfu, f.peak_bytes, f.plan_peak_bytes) == (0.4, int(61.2 * GIB), int(60.3 * GIB))
    assert f.mfu_text() == "36.5% (plan 40%)"
    assert f.peak_text() == "61.2 GiB (plan 60.3 GiB)"
    # A small run reads in MiB, not "0.0 GiB (plan 0.0)".
    small = dataclasses.replace(f, peak_bytes=int(91.3 * 2**20), plan_peak_bytes=int(219.0 * 2**20))
    assert small.peak_text() == "91.3 MiB (plan 219.0 MiB)"


def test_a_run_without_metrics_shows_only_the_plan(tmp_path):
    run_dir = make_run(tmp_path / "runs", "b", launch={"launcher": "local", "exit_code": 0})
    (run_dir / "plan.json").write_text(json.dumps({"device": "cpu", "assumed_mfu": 0.4, "memory": {"peak_bytes": GIB}}))
    f = figures(run_dir)
    assert f == Figures(plan_peak_bytes=GIB)  # no MFU is planned on CPU (no peak FLOP/s)
    assert (f.mfu_text(), f.peak_text()) == ("-", "- (plan 1.0 GiB)")


@pytest.mark.cli
def test_runs_and_status_show_measured_next_to_planned(tmp_path):
    done = make_run(tmp_path / "runs", "done", launch={"launcher": "local", "pid": 1, "host": "h", "exit_code": 0})
    write_figures(done)
    listing = cli("runs", cwd=tmp_path)
    assert listing.returncode == 0 and "heavy: []" in listing.stderr
    assert "36.5% (plan 40%)" in listing.stdout and "61.2 GiB (plan 60.3 GiB)" in listing.stdout
    status = cli("status", "done", cwd=tmp_path).stdout
    assert "mfu      36.5% (plan 40%)" in status
    assert "peak     61.2 GiB (plan 60.3 GiB), by cuda_max_memory_allocated" in status
