"""Resume: a run stopped and resumed equals the run done in one go, bitwise (fp32, gloo, deterministic).

A stop request (the test-side fault stop_after_step acts like the preemption signal)
checkpoints after step 10 and exits; the same run directory launched again resumes from it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from worker_runs import WORKER_TIMEOUT_S, base_config, records, write_run_dir

from tests.faults.worker_faults import fault_env
from tests.helpers import curve_rel, torchrun_cmd, worker_env
from trainctl.config.schema import CheckpointConfig, GuardsConfig, OptimConfig, ShardingConfig
from trainctl.train.checkpoint.store import list_committed, verify

pytestmark = pytest.mark.dist

STEPS, STOP_AT = 20, 10


def launch(run_dir: Path, nproc: int | None, **env) -> subprocess.CompletedProcess:
    if nproc is None:
        cmd = [sys.executable, "-m", "trainctl.train", str(run_dir)]
    else:
        cmd = torchrun_cmd(nproc, "-m", "trainctl.train", str(run_dir))
    return subprocess.run(cmd, env=worker_env(**env), capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)


def ok(proc: subprocess.CompletedProcess, run_dir: Path) -> None:
    logs = "\n".join(p.read_text() for p in sorted((run_dir / "logs").glob("*.log")))
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{proc.stderr[-3000:]}\n{logs[-3000:]}"


def losses(run_dir: Path) -> dict[int, float]:
    """Loss per step; a resumed attempt's records replace the earlier attempt's for the same steps."""
    return {r["step"]: r["loss"] for r in records(run_dir, "train")}


def final_weights(run_dir: Path, tmp: Path) -> dict[str, torch.Tensor]:
    (step, path), = list_committed(run_dir / "checkpoints")[-1:]
    out = tmp / f"{run_dir.name}-{step}.pt"
    with torch.serialization.safe_globals(_low_bit_states()):  # DCP reads the optimizer's part too
        dcp_to_torch_save(path, out)
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state["model"].items()}


def _low_bit_states() -> list[type]:
    """torchao's quantized optimizer state classes (optim.name=adamw8bit ...), which weights-only loading refuses."""
    try:
        from torchao.optim.subclass_4bit import OptimState4bit
        from torchao.optim.subclass_8bit import OptimState8bit
        from torchao.optim.subclass_fp8 import OptimStateFp8
    except ImportError:
        return []
    return [OptimState8bit, OptimState4bit, OptimStateFp8]


def config(cache, name: str, sharding: ShardingConfig, micro_batch: int, **ckpt):
    cfg = base_config(cache, steps=STEPS, micro_batch=micro_batch, grad_accum=8 // micro_batch // _dp(sharding))
    return replace(cfg, name=name, sharding=sharding, checkpoint=CheckpointConfig(**ckpt))


def _dp(s: ShardingConfig) -> int:
    return max(s.dp_replicate, 1) * max(s.dp_shard, 1)


LAYOUTS = {
    # name: (sharding, workers, micro_batch)
    "ddp": (ShardingConfig(strategy="ddp", dp_replicate=2), 2, 4),
    "zero3": (ShardingConfig(strategy="zero3", dp_shard=2), 2, 4),
    "tp": (ShardingConfig(strategy="none", tp=2), 2, 8),
    # zero1's optimizer shards are per rank (not resharded); pp: names stay the full model's.
    "zero1": (ShardingConfig(strategy="zero1", dp_replicate=2), 2, 4),
    "pp": (ShardingConfig(strategy="none", pp=2, pp_schedule="1f1b"), 2, 4),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_stop_and_resume_is_bitwise_identical(tmp_path, data_cache, layout):
    sharding, nproc, micro = LAYOUTS[layout]
    straight = write_run_dir(tmp_path, config(data_cache, "straight", sharding, micro))
    ok(launch(straight, nproc), straight)
    resumed = write_run_dir(tmp_path, config(data_cache, "resumed", sharding, micro))
    stopped = launch(resumed, nproc, **fault_env(stop_after_step=STOP_AT))
    ok(stopped, resumed)
    assert not (resumed / "result.json").exists()  # stopped early: no result yet
    assert [s for s, _ in list_committed(resumed / "checkpoints")] == [STOP_AT]
    ok(launch(resumed, nproc), resumed)
    resume_records = records(resumed, "resume")
    assert [r["step"] for r in resume_records] == [STOP_AT]
    assert losses(resumed) == losses(straight)  # every step, exactly
    assert len(losses(straight)) == STEPS
    a, b = final_weights(straight, tmp_path), final_weights(resumed, tmp_path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    result = json.loads((resumed / "result.json").read_text())
    assert result["resumed_from_step"] == STOP_AT and result["steps"] == STEPS


def stopped_and_resumed_equals_straight(tmp_path, run, nproc, stop_at: int, steps: int) -> tuple[Path, Path]:
    """`run(name)`'s config trained straight, and again stopped after `stop_at` and resumed: every loss and the
    final weights bitwise equal; the two run directories (straight, resumed)."""
    straight = write_run_dir(tmp_path, run("straight"))
    ok(launch(straight, nproc), straight)
    resumed = write_run_dir(tmp_path, run("resumed"))
    ok(launch(resumed, nproc, **fault_env(stop_after_step=stop_at)), resumed)
    assert [s for s, _ in list_committed(resumed / "checkpoints")] == [stop_at]
    ok(launch(resumed, nproc), resumed)
    assert [r["step"] for r in records(resumed, "resume")] == [stop_at]
    assert losses(resumed) == losses(straight) and len(losses(straight)) == steps
    a, b = final_weights(straight, tmp_path), final_weights(resumed, tmp_path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return straight, resumed


SINGLE = (ShardingConfig(strategy="none"), None, 8)  # one process: torchao compiles its step once per launch

# (optimizer config, layout, a state entry only it keeps): each optimizer through DCP (zero1: per-rank shards) on
# a layout it runs on, its own states coming back exactly. AdamW is test_stop_and_resume_is_bitwise_identical's.
OPTIMIZER_CASES = {
    "adafactor-ddp": (OptimConfig(name="adafactor", lr=1e-2, weight_decay=0.0), LAYOUTS["ddp"], "col_var"),
    "adafactor-zero1": (OptimConfig(name="adafactor", lr=1e-2, weight_decay=0.0), LAYOUTS["zero1"], "col_var"),
    "adafactor-pp": (OptimConfig(name="adafactor", lr=1e-2, weight_decay=0.0), LAYOUTS["pp"], "col_var"),
    "sgd-tp": (OptimConfig(name="sgd", lr=1e-2, momentum=0.9, nesterov=True), LAYOUTS["tp"], "momentum_buffer"),
    "lion-zero3": (OptimConfig(name="lion", lr=1e-4, beta2=0.99), LAYOUTS["zero3"], "exp_avg"),
    "muon-ddp": (OptimConfig(name="muon", momentum=0.95, nesterov=True), LAYOUTS["ddp"], "momentum_buffer"),
    "adamw8bit-single": pytest.param(OptimConfig(name="adamw8bit"), SINGLE, "exp_avg_sq", marks=pytest.mark.slow),
}


@pytest.mark.parametrize(("optim", "layout", "state_key"), list(OPTIMIZER_CASES.values()), ids=list(OPTIMIZER_CASES))
def test_each_optimizer_stop_and_resume_is_bitwise_identical(tmp_path, data_cache, optim, layout, state_key):
    """optim.name=NAME: its states go through the checkpoint and come back exactly."""
    sharding, nproc, micro = layout

    def run(name):
        return replace(config(data_cache, name, sharding, micro), optim=optim)

    straight, resumed = stopped_and_resumed_equals_straight(tmp_path, run, nproc, STOP_AT, STEPS)
    assert state_key in _optimizer_state_keys(resumed)  # the states that went through the checkpoint were its own


def _optimizer_state_keys(run_dir: Path) -> set[str]:
    """Names of the optimizer state entries of the newest checkpoint: DCP's, or zero1's per-rank shards."""
    (_, path), = list_committed(run_dir / "checkpoints")[-1:]
    keys = {k.rsplit(".", 1)[-1] for k in FileSystemReader(str(path)).read_metadata().state_dict_metadata}
    for rank_file in path.glob("rank-*.pt"):
        shard = torch.load(rank_file, weights_only=False).get("zero1_shard", {"state": {}})
        keys |= {name for state in shard["state"].values() for name in state}
    return keys


@pytest.fixture(scope="module")
def four_worker_runs(tmp_path_factory, data_cache):
    """zero3 on 4 workers: one run straight through, one stopped after step 10 (its checkpoint is the source)."""
    root = tmp_path_factory.mktemp("reshard")
    z4 = ShardingConfig(strategy="zero3", dp_shard=4)
    straight = write_run_dir(root, config(data_cache, "z4-straight", z4, 2))
    ok(launch(straight, 4), straight)
    source = write_run_dir(root, config(data_cache, "z4-stopped", z4, 2))
    ok(launch(source, 4, **fault_env(stop_after_step=STOP_AT)), source)
    return root, straight, source


@pytest.mark.parametrize("target", ["zero3x2", "single", "fsdp2+tp2"])
def test_resharded_resume_continues_the_loss(four_worker_runs, data_cache, target):
    root, straight, source = four_worker_runs
    sharding, nproc, micro = {
        "zero3x2": (ShardingConfig(strategy="zero3", dp_shard=2), 2, 4),
        "single": (ShardingConfig(), None, 8),
        "fsdp2+tp2": (ShardingConfig(strategy="fsdp", dp_shard=2, tp=2), 4, 4),
    }[target]
    checkpoint = list_committed(source / "checkpoints")[-1][1]
    # A new run that starts from the other run's checkpoint with everything (step, data position too).
    cfg = config(data_cache, f"from-4-{target}", sharding, micro, resume=str(checkpoint), load_only="all")
    run_dir = write_run_dir(root, cfg)
    ok(launch(run_dir, nproc), run_dir)
    got, want = losses(run_dir), losses(straight)
    assert sorted(got) == list(range(STOP_AT + 1, STEPS + 1))
    # Resharding changes the order of floating-point sums: rounding's bound for the steps so far, not bitwise.
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=curve_rel(step)), step
    log = (run_dir / "logs" / "rank0.log").read_text()
    assert "resharded" in log or nproc == 4


def test_load_only_model_starts_a_fresh_run_from_the_weights(four_worker_runs, data_cache):
    root, straight, source = four_worker_runs
    cfg = config(data_cache, "finetune", ShardingConfig(), 8, resume=str(source), load_only="model")
    run_dir = write_run_dir(root, cfg)
    ok(launch(run_dir, None), run_dir)
    got = losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))  # a fresh schedule from step 0
    # Its first loss is that of trained weights (well below the untrained run's first loss).
    assert got[1] < losses(straight)[1] - 0.5


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_nan_at_a_chosen_step(tmp_path, data_cache, policy):
    sharding, nproc, micro = LAYOUTS["ddp"]
    cfg = config(data_cache, f"nan-{policy}", sharding, micro, every=4)
    cfg = replace(cfg, guards=GuardsConfig(nonfinite=policy))
    run_dir = write_run_dir(tmp_path, cfg)
    proc = launch(run_dir, nproc, **fault_env(nan_at_step=7))
    log = (run_dir / "logs" / "rank0.log").read_text()
    if policy == "stop":
        assert proc.returncode != 0 and "Traceback" not in log
        errors = [line for line in log.splitlines() if " ERROR " in line]
        assert len(errors) == 1 and "step 7" in errors[0] and "not finite" in errors[0], errors
        assert max(losses(run_dir)) == 6  # stopped at step 7, before its update and its log line
        assert [s for s, _ in list_committed(run_dir / "checkpoints")] == [4]
        assert verify(list_committed(run_dir / "checkpoints")[-1][1]) == []
    else:
        ok(proc, run_dir)
        result = json.loads((run_dir / "result.json").read_text())
        assert result["guard_skipped_steps"] == 1 and result["steps"] == STEPS
        assert all(v == v for s, v in losses(run_dir).items() if s != 7)  # only the injected step is NaN


def test_async_save_gives_the_same_run_and_valid_checkpoints(tmp_path, data_cache):
    sharding, nproc, micro = LAYOUTS["zero3"]
    sync = write_run_dir(tmp_path, config(data_cache, "sync", sharding, micro, every=5))
    ok(launch(sync, nproc), sync)
    run_dir = write_run_dir(tmp_path, config(data_cache, "async", sharding, micro, every=5, async_save=True))
    ok(launch(run_dir, nproc), run_dir)
    assert losses(run_dir) == losses(sync)
    committed = list_committed(run_dir / "checkpoints")
    assert [s for s, _ in committed] == [15, 20] and all(verify(p) == [] for _, p in committed)
    saves = records(run_dir, "checkpoint")
    assert [r["step"] for r in saves] == [5, 10, 15, 20] and all(r["blocking_s"] <= r["total_s"] for r in saves)


def test_stop_and_resume_inside_the_batch_ramp_is_bitwise_identical(tmp_path, data_cache):
    """train.batch_ramp: stopped at a step inside the ramp and resumed, every step's loss and the final weights are
    the uninterrupted run's, and metrics.jsonl carries each step's planned global batch and its lr on the tokens
    clock (core/batch_ramp.py)."""
    from trainctl.config.schema import BatchRampConfig
    from trainctl.core.batch_ramp import BatchRamp
    from trainctl.core.schedules import lr_at

    sharding, nproc, stop_at, steps = ShardingConfig(strategy="ddp", dp_replicate=2), 2, 5, 12

    def run(name):  # global 8 = micro 1 x accum 4 x dp 2; the ramp starts at 2 (accum 1) and grows over 8 steps
        cfg = config(data_cache, name, sharding, 1)
        return replace(cfg, train=replace(cfg.train, steps=steps, eval_every=steps,
                                          batch_ramp=BatchRampConfig(start=2, steps=8)))

    straight, resumed = stopped_and_resumed_equals_straight(tmp_path, run, nproc, stop_at, steps)
    ramp, cfg = BatchRamp.of(run("x").train, 2), run("x")
    assert ramp.accum_at(stop_at) < ramp.final_accum  # the stop was inside the ramp
    for r in records(resumed, "train"):
        assert r["global_batch"] == ramp.batch_at(r["step"] - 1) and r["tokens"] == r["global_batch"] * 64
        assert r["tokens_seen"] == ramp.sequences_before(r["step"]) * 64
        lr = lr_at(ramp.position(r["step"] - 1), cfg.optim.lr, cfg.schedule, ramp.schedule_length())
        assert r["lr"] == lr
    assert [r["global_batch"] for r in records(straight, "train")][:9] == [2, 2, 2, 4, 4, 4, 6, 6, 8]
    assert [r["step"] for r in records(straight, "memory")] == [11]  # measured at the full batch, as planned
