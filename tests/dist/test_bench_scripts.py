"""Smoke tests of scripts/bench_loop.py, bench_checkpoint.py, bench_prepare.py, bench_titan.py (and
titan_worker.py), gpu_proof.sh, gpu_wheels.sh.

Each runs the script as a user would (a fresh interpreter: a gloo world of one, or torchrun for --nproc 2)
and checks that it reports every figure it promises; the figures themselves are measurements, not asserted.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"

pytestmark = pytest.mark.dist


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(variable, None)
    return subprocess.run([sys.executable, str(SCRIPTS / name), *args], capture_output=True, text=True, timeout=300,
                          env=env)


def test_bench_loop_runs_the_worker_loop_next_to_a_bare_one(tmp_path):
    out = tmp_path / "loop.json"
    proc = run_script("bench_loop.py", "--steps", "3", "--warmup", "3", "--rounds", "2", "train.seq_len=32",
                      "train.micro_batch=2", "train.grad_accum=2", "cluster.cpu_threads=1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ratio trainctl/bare" in proc.stdout
    result = json.loads(out.read_text())
    assert len(result["bare_tokens_per_s"]) == len(result["trainctl_tokens_per_s"]) == 2
    assert all(x > 0 for x in result["bare_tokens_per_s"] + result["trainctl_tokens_per_s"])
    assert result["ratio_best"] > 0 and result["ratio_median"] > 0
    assert result["batch"] == "2x2x32" and result["steps"] == 3 and result["precision"] == "fp32"


def test_bench_loop_takes_a_recipe_and_a_lower_precision(tmp_path):
    # Any recipe and precision: bf16 autocast in the bare arm, the recipe's own path in trainctl's (tiny shapes).
    out = tmp_path / "loop.json"
    proc = run_script("bench_loop.py", "--recipe", "tiny_cpu", "--device", "cpu", "--steps", "2", "--warmup", "2",
                      "--rounds", "1", "sharding=none", "precision=bf16", "train.seq_len=16", "train.micro_batch=1",
                      "train.grad_accum=1", "model.n_layers=1", "cluster.cpu_threads=1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["recipe"] == "tiny_cpu" and result["precision"] == "bf16" and result["batch"] == "1x1x16"


@pytest.mark.parametrize("nproc", [1, 2])
def test_bench_checkpoint_reports_every_figure(tmp_path, nproc):
    out = tmp_path / "checkpoint.json"
    proc = run_script("bench_checkpoint.py", "--dim", "64", "--layers", "2", "--heads", "4", "--vocab", "256",
                      "--nproc", str(nproc), "--repeats", "1", "--dir", str(tmp_path / "work"), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["ranks"] == nproc and summary["params"] > 0 and summary["checkpoint_mib"] > 0
    for key in ("sync_s", "async_blocking_s", "async_total_s", "verify_s", "raw_write_s",
                "sync_mib_s", "async_mib_s", "raw_write_mib_s", "verify_mib_s"):
        assert summary[key] > 0, key
    assert len(summary["repeats"]) == 1
    assert not (tmp_path / "work").exists()  # the script leaves nothing behind
    assert "sync save (committed)" in proc.stdout


def run_shell(name: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPTS / name), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_gpu_proof_checks_the_box_and_refuses_unknown_stages(tmp_path):
    proc = run_shell("gpu_proof.sh", "check", env={"OUT": str(tmp_path / "out")})
    if shutil.which("nvidia-smi") is None:
        assert proc.returncode == 3 and "no NVIDIA GPU" in proc.stdout, proc.stdout + proc.stderr
    else:  # on a GPU box: the versions and the compiler verdict
        assert proc.returncode == 0 and "torch.compile" in proc.stdout, proc.stdout + proc.stderr
    # One log for every stage, with each stage's wall time; the $OUT listing is checked against the tool's limits.
    assert "=== check: exit" in (tmp_path / "out" / "proof.log").read_text()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["proof.log"]
    for bad in ("benchmark-everything", "variants:1/x"):
        refused = run_shell("gpu_proof.sh", bad, env={"OUT": str(tmp_path / "bad")})
        assert refused.returncode == 2 and "unknown stage" in refused.stderr and not (tmp_path / "bad").exists()


def test_gpu_wheels_names_what_the_gpu_box_lacks():
    # The names come from scripts/_gpu_common.sh, which gpu_proof.sh installs them by.
    proc = run_shell("gpu_wheels.sh", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    for package in ("hydra-core==", "omegaconf==", "torchao==", "antlr4-python3-runtime==4.9.3"):
        assert package in proc.stdout, package
    # Only what the image lacks: PyYAML, pytest, safetensors are there (one PyYAML per Python stopped pip).
    for present in ("PyYAML", "pytest", "safetensors", "wandb"):
        assert present not in proc.stdout, present
    assert "names:  hydra-core omegaconf antlr4-python3-runtime torchao" in proc.stdout
    assert "for CPython 3.12" in proc.stdout
    # torchtitan for the titan stage: the release that imports under torch 2.11, and what it imports to train;
    # not HF datasets (pyarrow, pandas: tens of MB), whose text dataloader bench_titan does not use.
    assert "titan:  torchtitan==0.2.2 torchdata==" in proc.stdout and "tyro==" in proc.stdout
    assert "datasets" not in proc.stdout
    assert "titan names: torchtitan torchdata (no deps) tyro docstring-parser typeguard" in proc.stdout


def test_bench_titan_writes_torchtitan_s_config_and_compares_results(tmp_path):
    # The run itself needs torchtitan (scripts/gpu_proof.sh --rehearse titan runs it on CPU): here the
    # recipe -> torchtitan config, the ratio from two results of separate device calls, and a refusal.
    proc = run_script("bench_titan.py", "--dry-run", "train.micro_batch=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[training]\nlocal_batch_size = 4\nglobal_batch_size = 4\nseq_len = 2048" in proc.stdout
    assert '"ffn_dim": 8192' in proc.stdout
    shape = {"recipe": "llama1b_bench", "model": "llama3_1b", "batch": "8x1x2048", "precision": "bf16",
             "compile": True}
    (tmp_path / "titan.json").write_text(json.dumps({**shape, "tokens_per_s": 40000.0, "mfu_pct": 40.0,
                                                     "tflops": 400.0, "flops_per_token": 8e9, "peak_flops": 989e12,
                                                     "tokens_per_s_intervals": [40000.0], "peak_active_gib": 30.0}))
    (tmp_path / "loop.json").write_text(json.dumps({**shape, "fp8": False, "trainctl_tokens_per_s": [42000.0]}))
    proc = run_script("bench_titan.py", "--compare", str(tmp_path / "titan.json"),
                      "--loop", str(tmp_path / "loop.json"), "--json", str(tmp_path / "both.json"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ratio trainctl/torchtitan tokens/s: 1.050" in proc.stdout
    assert json.loads((tmp_path / "both.json").read_text())["vs_trainctl"]["comparable"] is True
    refused = run_script("bench_titan.py", "--dry-run", "precision=fp8")
    assert refused.returncode == 1 and "bench_titan: precision.fp8" in refused.stderr
    assert "Traceback" not in refused.stderr
    # Its torchtitan side (what the rehearsal runs) says how it is used rather than failing on a missing argument.
    usage = run_script("titan_worker.py")
    assert usage.returncode == 1 and "usage: titan_worker.py SPEC_JSON" in usage.stderr


def test_bench_prepare_compares_data_prepare_with_tokenizers_alone():
    proc = run_script("bench_prepare.py", "--generate-mb", "0.3", "--workers", "2", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout)
    # Both arms tokenized the same text into the same number of tokens (prepare adds one EOS per document).
    assert figures["tokens"] == figures["tokens_alone"] > 0
    assert figures["prepare_mb_s"] > 0 and figures["tokenizers_alone_mb_s"] > 0 and figures["documents"] > 10
