"""Smoke test of scripts/bench_variants.py: one variant of the CPU recipe through the real CLI and torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_variants.py"

pytestmark = pytest.mark.dist


def test_bench_variants_reports_each_variant_from_its_metrics(tmp_path, data_cache):
    base = ["sharding=none", "cluster.procs_per_node=1", "train.steps=6", "schedule.warmup_steps=2",
            "logging.log_every=2",
            "train.seq_len=64", f"data.cache_dir={data_cache}"]
    cmd = [sys.executable, str(SCRIPT), "--recipe", "tiny_cpu", "--base", *base,
           "--variants", "eager", "--out", str(tmp_path / "bench")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    (result,) = report["results"]
    assert result["exit_code"] == 0 and "error" not in result, result
    assert result["variant"] == "eager" and "train.compile=false" in result["overrides"]
    assert result["tokens_per_s"] > 0 and result["step_time_s"] > 0
    assert result["final_loss"] == result["final_loss"]  # a number, not NaN
    # The plan's peak beside the measured one (CPU: the profiler's tracked tensors), from the worker's memory record.
    assert result["plan_peak_gib"] > 0 and result["measured_peak_gib"] > 0, result
    assert abs(result["plan_peak_error"]) < 1, result
    assert report["device"].startswith("cpu") and report["command"].startswith("python scripts/bench_variants.py")
    assert "| eager |" in (tmp_path / "bench.md").read_text()
    first = Path(result["run_dir"])
    assert first.name == "eager" and not (first / "checkpoints").exists() or not any((first / "checkpoints").iterdir())
    # Again into the same runs folder: the launcher names the new run eager-1, and that is the one read.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    (again,) = json.loads((tmp_path / "bench.json").read_text())["results"]
    assert Path(again["run_dir"]).name == "eager-1" and again["tokens_per_s"] > 0


def test_a_part_runs_its_slice_without_evaluation_and_keeps_runs_out_of_the_results_folder(tmp_path, data_cache):
    # tiny_cpu evaluates every 25 steps and at step 0; the benchmark must not (a second compiled graph on GPU).
    base = ["sharding=none", "cluster.procs_per_node=1", "train.steps=4", "schedule.warmup_steps=1",
            "logging.log_every=2",
            "train.seq_len=64", "train.eval_every=2", f"data.cache_dir={data_cache}"]
    out, runs = tmp_path / "out", tmp_path / "runs"
    cmd = [sys.executable, str(SCRIPT), "--recipe", "tiny_cpu", "--base", *base, "--variants", "eager", "ac_full",
           "--part", "2/2", "--out", str(out / "variants-2of2"), "--runs-dir", str(runs)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    (result,) = json.loads((out / "variants-2of2.json").read_text())["results"]
    assert result["variant"] == "ac_full" and result["exit_code"] == 0 and result["tokens_per_s"] > 0, result
    records = [json.loads(line) for line in (Path(result["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in records if r.get("kind") == "train"]
    assert not [r for r in records if r.get("kind") == "eval"], records  # no evaluation pass ran
    assert sorted(p.name for p in out.iterdir()) == ["variants-2of2.json", "variants-2of2.md"]
    assert Path(result["run_dir"]).parent == runs
