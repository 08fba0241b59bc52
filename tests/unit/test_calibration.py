"""`trainctl plan`'s calibration (trainctl/runs/calibration.py): its error on past runs of the same layout."""

from __future__ import annotations

import json

import pytest

from trainctl import api
from trainctl.config.load import to_yaml
from trainctl.runs.calibration import calibration


def fake_run(run_dir, cfg, tokens_per_s, peak, plan_peak, plan_tokens=None):
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    plan = {"memory": {"peak_bytes": plan_peak}, "throughput": {"tokens_per_s": plan_tokens}}
    (run_dir / "plan.json").write_text(json.dumps(plan))
    records = [{"kind": "train", "step": s, "tokens_per_s": tokens_per_s} for s in (1, 2, 3, 4)]
    records.append({"kind": "memory", "step": 3, "peak_bytes": peak})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture
def runs(tmp_path):
    cfg = api.resolved(["recipe=tiny_cpu", f"runs_dir={tmp_path}"])
    other = api.resolved(["recipe=tiny_cpu", f"runs_dir={tmp_path}", "sharding=zero3"])
    fake_run(tmp_path / "a", cfg, 100.0, 1100, 1000, plan_tokens=50.0)
    fake_run(tmp_path / "tune" / "t" / "probe-01", cfg, 300.0, 1300, 1000, plan_tokens=100.0)
    fake_run(tmp_path / "zero3", other, 900.0, 9000, 1000)  # another layout: not counted
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "config.yaml").write_text(": not yaml [")
    return cfg


def test_only_runs_of_the_same_layout_count_with_the_mean_error(runs):
    found = calibration(runs)
    assert found["runs"] == 2
    assert found["measured_tokens_per_s"] == 200.0 and found["measured_peak_bytes"] == 1300
    assert found["tokens_per_s_error"] == pytest.approx((1.0 + 2.0) / 2)
    assert found["peak_bytes_error"] == pytest.approx((0.1 + 0.3) / 2)


def test_plan_shows_it_and_says_nothing_without_past_runs(runs, tmp_path):
    assert api.plan_record(runs)["calibration"]["runs"] == 2
    fresh = api.resolved(["recipe=tiny_cpu", f"runs_dir={tmp_path / 'none'}"])
    assert "calibration" not in api.plan_record(fresh)
