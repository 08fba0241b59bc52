"""result.json's `performance` (trainctl/core/measured.py): the plan's speed and peak beside what the run logged."""

from __future__ import annotations

import json

from trainctl.core import measured


def write_run(run_dir, speeds, peaks, plan_tokens=None, plan_peak=1000):
    records = [{"kind": "train", "step": i + 1, "tokens_per_s": s} for i, s in enumerate(speeds)]
    records += [{"kind": "memory", "step": 3, "peak_bytes": p} for p in peaks]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    plan = {"memory": {"peak_bytes": plan_peak}, "throughput": {"tokens_per_s": plan_tokens}}
    (run_dir / "plan.json").write_text(json.dumps(plan))


def test_speed_is_the_median_after_the_first_quarter_and_the_peak_the_largest(tmp_path):
    write_run(tmp_path, [10.0, 500.0, 200.0, 100.0, 300.0, 200.0, 100.0, 200.0], [900, 1100])
    assert measured.measured(tmp_path) == (200.0, 1100)


def test_performance_has_both_sides_and_the_errors(tmp_path):
    write_run(tmp_path, [1.0, 120.0, 120.0, 120.0], [1200], plan_tokens=100.0, plan_peak=1000)
    perf = measured.performance(tmp_path)
    assert perf["predicted"] == {"tokens_per_s": 100.0, "peak_bytes": 1000}
    assert perf["measured"] == {"tokens_per_s": 120.0, "peak_bytes": 1200}
    assert abs(perf["error"]["tokens_per_s"] - 0.2) < 1e-12
    assert abs(perf["error"]["peak_bytes"] - 0.2) < 1e-12


def test_what_nobody_predicted_or_logged_is_none(tmp_path):
    write_run(tmp_path, [], [], plan_tokens=None)
    perf = measured.performance(tmp_path)
    assert perf["measured"] == {"tokens_per_s": None, "peak_bytes": None}
    assert perf["predicted"]["tokens_per_s"] is None and perf["error"] == {"tokens_per_s": None, "peak_bytes": None}
    assert measured.performance(tmp_path / "missing")["predicted"] == {"tokens_per_s": None, "peak_bytes": None}
