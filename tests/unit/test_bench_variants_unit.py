"""scripts/bench_variants.py's bookkeeping, without launching: which run directory, and what survives a failure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_variants  # noqa: E402


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


def test_every_launch_runs_without_evaluation_checkpoints_or_wandb_whatever_the_base_says(monkeypatch, tmp_path):
    calls = _launch(monkeypatch, 2, "", "stopped")
    base = ["train.eval_every=5", "checkpoint.every=10", "logging.wandb.mode=online"]
    bench_variants.run_variant("tiny_cpu", base, [], tmp_path, "eager")
    (cmd,) = calls
    # Hydra applies overrides in order: the bench's own come after the user's, so they win.
    assert cmd.index("train.eval_every=0") > cmd.index("train.eval_every=5")
    assert cmd.index("checkpoint.every=0") > cmd.index("checkpoint.every=10")
    assert cmd.index("logging.wandb.mode=disabled") > cmd.index("logging.wandb.mode=online")


@pytest.mark.parametrize("count", [1, 2, 3, 4, 6, 7])
def test_the_parts_split_the_variants_into_contiguous_slices_that_cover_them_once(count):
    names = [f"v{i}" for i in range(6)]
    parts = [bench_variants.part_of(names, f"{i}/{count}") for i in range(1, count + 1)]
    assert [name for part in parts for name in part] == names
    sizes = [len(part) for part in parts]
    assert max(sizes) - min(sizes) <= 1
    assert bench_variants.part_of(names, None) == names


@pytest.mark.parametrize("part", ["0/2", "3/2", "1", "a/b", "1/0", "-1/2"])
def test_a_malformed_part_is_refused(part):
    with pytest.raises(SystemExit, match="expected I/N"):
        bench_variants.part_of(["eager", "compile"], part)


def test_results_are_written_after_each_variant_so_a_killed_call_keeps_them(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench_variants, "device_name", lambda: "cpu test")
    ran = []

    def fake_variant(recipe, base, extra, runs_dir, name):
        if ran:  # the second variant: the device call's time limit strikes
            raise KeyboardInterrupt
        ran.append(name)
        return {"variant": name, "overrides": extra, "exit_code": 0, "tokens_per_s": 10.0, "mfu": 0.1,
                "step_time_s": 1.0, "peak_mem_gib": 1.0, "peak_reserved_gib": 1.0, "final_loss": 3.0}

    monkeypatch.setattr(bench_variants, "run_variant", fake_variant)
    out = tmp_path / "out" / "variants-1of2"
    runs = tmp_path / "runs"
    with pytest.raises(KeyboardInterrupt):
        bench_variants.main(["--recipe", "tiny_cpu", "--variants", "eager", "compile", "ac_full", "fp8",
                             "--part", "1/2", "--out", str(out), "--runs-dir", str(runs)])
    report = json.loads(out.with_suffix(".json").read_text())
    assert [r["variant"] for r in report["results"]] == ["eager"] and report["device"] == "cpu test"
    assert "| eager | 10 |" in out.with_suffix(".md").read_text()
    assert "eager done (1 of 2)" in capsys.readouterr().out
    assert sorted(p.name for p in out.parent.iterdir()) == ["variants-1of2.json", "variants-1of2.md"]


def test_a_part_beyond_the_variants_is_refused_before_any_launch(monkeypatch, tmp_path):
    monkeypatch.setattr(bench_variants, "run_variant", lambda *a: pytest.fail("launched"))
    with pytest.raises(SystemExit, match="selects none"):
        bench_variants.main(["--variants", "eager", "--part", "2/2", "--out", str(tmp_path / "v")])


def test_a_failed_variant_fails_the_run_after_every_result_is_written(monkeypatch, tmp_path):
    monkeypatch.setattr(bench_variants, "device_name", lambda: "cpu test")
    outcomes = {"eager": {"error": ["CUDA out of memory"]}, "compile": {"tokens_per_s": 5.0, "mfu": 0.1,
                "step_time_s": 1.0, "peak_mem_gib": 1.0, "peak_reserved_gib": 1.0, "final_loss": 3.0}}
    monkeypatch.setattr(bench_variants, "run_variant", lambda recipe, base, extra, runs, name: {
        "variant": name, "overrides": extra, "exit_code": 0, **outcomes[name]})
    out = tmp_path / "v"
    assert bench_variants.main(["--variants", "eager", "compile", "--out", str(out)]) == 1
    assert [r["variant"] for r in json.loads(out.with_suffix(".json").read_text())["results"]] == ["eager", "compile"]
    outcomes["eager"] = outcomes["compile"]
    assert bench_variants.main(["--variants", "eager", "compile", "--out", str(out)]) == 0


def test_the_plans_peak_is_reported_beside_the_measured_one(tmp_path):
    run_dir = tmp_path / "run"
    _metrics(run_dir, 3)
    memory = {"kind": "memory", "step": 3, "peak_bytes": 40 * 2**30, "peak_source": "cuda_max_memory_allocated",
              "predicted": {"peak_bytes": 44 * 2**30}}
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(memory) + "\n")
    figures = bench_variants.summarize(run_dir / "metrics.jsonl")
    assert figures["plan_peak_gib"] == 44 and figures["measured_peak_gib"] == 40
    assert figures["plan_peak_error"] == pytest.approx(0.1)
    row = bench_variants.markdown([{"variant": "eager", "overrides": [], **figures}], "# t").splitlines()[-1]
    assert "44.0 (+10% vs 40.0)" in row
    # Without a memory record (or a plan) nothing is invented.
    _metrics(tmp_path / "bare", 3)
    assert "plan_peak_gib" not in bench_variants.summarize(tmp_path / "bare" / "metrics.jsonl")
