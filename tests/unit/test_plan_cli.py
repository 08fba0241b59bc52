"""`trainctl plan --compare` and `launch`'s refusal of a plan that does not fit, as a user runs them."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from test_cli import trainctl

pytestmark = pytest.mark.cli

ROWS_KEYS = {
    "variant",
    "overrides",
    "states_bytes",
    "optimizer_bytes",
    "activations_bytes",
    "peak_bytes",
    "need_bytes",
    "headroom_bytes",
    "verdict",
    "step_time_s",
    "slowdown",
    "tokens_per_s",
}


def test_compare_sharding_lists_each_strategy_for_the_users_model(tmp_path):
    proc = trainctl("plan", "recipe=llama7b_fsdp", "--compare", "sharding", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.probe["heavy"] == []
    for variant in ("(as configured)", "ddp", "zero1", "zero2", "zero3+offload"):
        assert variant in proc.stdout
    assert "does not fit" in proc.stdout and "fits" in proc.stdout  # 7B under ddp vs fsdp on H100s


def test_compare_json_has_one_row_per_variant_with_memory_and_time(tmp_path):
    proc = trainctl("plan", "recipe=llama7b_fsdp", "--compare", "checkpointing", "--json", cwd=tmp_path)
    data = json.loads(proc.stdout)
    assert data["axis"] == "checkpointing"
    rows = {r["variant"]: r for r in data["rows"]}
    assert set(rows) == {"(as configured)", "ac=none", "ac=selective", "ac=op"}  # the recipe runs full
    assert all(ROWS_KEYS <= set(r) for r in rows.values())
    # Less checkpointing keeps more activations and costs less recompute.
    assert (
        rows["ac=none"]["activations_bytes"]
        > rows["ac=selective"]["activations_bytes"]
        > rows["(as configured)"]["activations_bytes"]
    )
    assert rows["ac=none"]["slowdown"] < 0 == rows["(as configured)"]["slowdown"]


def test_compare_micro_batch_keeps_the_global_batch(tmp_path):
    data = json.loads(trainctl("plan", "recipe=tiny_cpu", "--compare", "micro-batch", "--json", cwd=tmp_path).stdout)
    labels = [r["variant"] for r in data["rows"]]
    assert labels[0] == "(as configured)" and "micro_batch=1" in labels
    peaks = [r["peak_bytes"] for r in data["rows"][1:]]
    assert peaks == sorted(peaks)  # larger micro-batches, more memory


def test_compare_optim_shows_each_optimizers_state_side_by_side(tmp_path):
    data = json.loads(trainctl("plan", "recipe=tiny_cpu", "--compare", "optim", "--json", cwd=tmp_path).stdout)
    rows = {r["variant"]: r["optimizer_bytes"] for r in data["rows"]}
    assert set(rows) == {"(as configured)", "adafactor", "sgd", "lion", "adamw8bit", "adamw4bit", "adamwfp8",
                         "muon"}  # tiny_cpu runs ddp: whole tensors, every optimizer can run
    assert data["rows"][-1]["overrides"] == ["optim=muon"]
    adamw = rows["(as configured)"]
    # AdamW's two fp32 moments (+ a step each tensor); one for SGD's momentum and Lion; quantized moments far less.
    assert rows["sgd"] == rows["lion"] < adamw < 2 * rows["lion"] + 4096
    assert rows["adamw4bit"] < rows["adamw8bit"] < adamw / 3
    assert rows["lion"] < rows["muon"] < adamw
    table = trainctl("plan", "recipe=tiny_cpu", "--compare", "optim", cwd=tmp_path).stdout
    assert "muon" in table and "optim." in table


def test_compare_unknown_axis_is_one_line_and_exit_2(tmp_path):
    proc = trainctl("plan", "recipe=tiny_cpu", "--compare", "colour", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --compare colour: not an axis; use one of: sharding, checkpointing, tp, micro_batch, optim, ep"
    ]


def test_launch_refuses_a_plan_that_does_not_fit(tmp_path):
    # PATH without sbatch, whether or not this machine has Slurm (the Slurm tests install it).
    proc = trainctl_with_path("launch", "recipe=llama2_13b_pp", cwd=tmp_path, path=str(Path(sys.executable).parent))
    assert proc.returncode == 2
    # Every problem at once, one line each: the memory verdict first (the recipe's token files are absent here).
    line, *others = proc.stderr.strip().splitlines()
    assert all(o.startswith(("error: data.", "error: cluster.launcher=slurm: sbatch")) for o in others), others
    assert line.startswith("error: does not fit: pp rank 0 needs ") and "GiB of one h100" in line
    assert "; try " in line and "--force" in line and "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()  # nothing written, nothing submitted


def test_launch_force_goes_past_the_memory_check(tmp_path):
    # Without sbatch on PATH the launch stops at the next check: proof the memory check let it through.
    env_path = str(Path(sys.executable).parent)
    proc = trainctl_with_path("launch", "recipe=llama2_13b_pp", "--force", cwd=tmp_path, path=env_path)
    assert proc.returncode == 2
    assert "sbatch was not found" in proc.stderr and "does not fit" not in proc.stderr


def test_dry_run_of_a_plan_that_does_not_fit_is_refused_unless_forced(tmp_path):
    args = ("launch", "recipe=llama2_13b_pp", "data=synthetic", "--dry-run", "--name", "big")
    refused = trainctl(*args, cwd=tmp_path)
    assert refused.returncode == 2 and "does not fit" in refused.stderr and "--force" in refused.stderr
    assert not (tmp_path / "runs").exists()
    proc = trainctl(*args, "--force", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "does not fit" in proc.stderr
    plan = json.loads((tmp_path / "runs" / "big" / "plan.json").read_text())
    assert plan["memory"]["verdict"] == "does not fit" and plan["advice"]
    assert f"sbatch {tmp_path / 'runs' / 'big' / 'launch.sh'}" in proc.stdout  # a Slurm script is submitted


def trainctl_with_path(*args: str, cwd: Path, path: str):
    old = os.environ["PATH"]
    os.environ["PATH"] = path
    try:
        return trainctl(*args, cwd=cwd)
    finally:
        os.environ["PATH"] = old
