"""scripts/bench_variants.py's bookkeeping, without launching: which run directory, and what survives a failure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_variants  # noqa: E402

pytestmark = pytest.mark.unit


def _metrics(run_dir: Path, steps: int) -> None:
    run_dir.mkdir(parents=True)
    records = [{"kind": "train", "step": s, "tokens_per_s": 1000.0 + s, "step_time_s": 0.5, "mfu": 0.4,
                "loss": 5.0 - s / 10, "peak_mem_gib": 10.0, "peak_reserved_gib": 12.0} for s in range(1, steps + 1)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _launch(monkeypatch, returncode: int, stdout: str, stderr: str = "") -> list:
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, returncode, stdout, stderr)

    monkeypatch.setattr(bench_variants.subprocess, "run", fake_run)
    return calls


def test_the_run_directory_is_the_one_the_launch_printed_not_the_name(monkeypatch, tmp_path):
    _metrics(tmp_path / "eager", 3)  # an older run of the same name, with its own figures
    _metrics(tmp_path / "eager-1", 5)
    calls = _launch(monkeypatch, 0, f"plan ...\nrun directory: {tmp_path / 'eager-1'}\n")
    result = bench_variants.run_variant("tiny_cpu", [], ["train.compile=false"], tmp_path, "eager")
    assert result["run_dir"] == str(tmp_path / "eager-1") and "error" not in result
    assert result["final_loss"] == pytest.approx(4.5)  # eager-1's last record, not eager's
    assert "checkpoint.save_final=false" in calls[0] and "checkpoint.every=0" in calls[0]


def test_metrics_survive_a_failure_after_training(monkeypatch, tmp_path):
    _metrics(tmp_path / "fp8", 4)
    _launch(monkeypatch, 1, f"run directory: {tmp_path / 'fp8'}\n", "CheckpointError: disk full")
    result = bench_variants.run_variant("tiny_cpu", [], [], tmp_path, "fp8")
    assert result["exit_code"] == 1 and result["error"] == ["CheckpointError: disk full"]
    assert result["tokens_per_s"] == pytest.approx(1003.0) and result["peak_reserved_gib"] == 12.0
    assert 0 < result["mfu_causal"] < result["mfu"]
    table = bench_variants.markdown([result], "# t")
    assert "| fp8 (then failed: CheckpointError: disk full) | 1,003 |" in table


def test_a_launch_that_printed_no_run_directory_is_an_error(monkeypatch, tmp_path):
    _metrics(tmp_path / "eager", 3)
    _launch(monkeypatch, 2, "", "recipe: no such option")
    result = bench_variants.run_variant("tiny_cpu", [], [], tmp_path, "eager")
    assert "tokens_per_s" not in result and result["error"] == ["recipe: no such option"]
