"""The run plan: topology, batch math, FLOPs, memory, warnings and the launch command."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers import LLAMA2_7B
from trainctl.config.schema import ClusterConfig, PrecisionConfig, RunConfig, ShardingConfig, TrainConfig
from trainctl.config.slurm import SlurmClusterConfig
from trainctl.launch.command import command_record, default_run_dir, launch_argv, plan_record
from trainctl.plan import fit
from trainctl.plan.runplan import PlanError, build, refusal
from trainctl.plan.throughput import DEFAULT_MFU, RECOMPUTE_SPEEDUP

P_7B = 6_738_415_616  # published; see test_memory for the arithmetic
BLOCK_7B = 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096


def plain_flops_per_token() -> float:
    return 6 * 6_607_077_376 + 12 * 32 * 4096 * 4096  # see test_params_and_flops_of_llama2_7b


# The machine the local 8-GPU configs below are planned for (the plan compares a local launch with it).
EIGHT_H100 = fit.Machine(("NVIDIA H100 80GB HBM3",) * 8)


def llama7b_zero3_h100(**train) -> RunConfig:
    """Llama 2 7B, FSDP (zero3) over 8 H100s of one node, bf16, 64 x 4096-token sequences per step, full AC."""
    return RunConfig(
        recipe="llama7b_fsdp",
        model=LLAMA2_7B,
        precision=PrecisionConfig(compute_dtype="bf16"),
        sharding=ShardingConfig(strategy="zero3", dp_shard=8),
        cluster=ClusterConfig(launcher="local", nodes=1, procs_per_node=8, device="cuda", gpu="h100"),
        train=TrainConfig(
            **{
                "steps": 1000,
                "seq_len": 4096,
                "global_batch": 64,
                "micro_batch": 2,
                "grad_accum": 4,
                "activation_checkpointing": "full",
                **train,
            }
        ),
    )


def replace(cfg: RunConfig, **groups) -> RunConfig:
    """Replace fields inside groups: replace(cfg, sharding={"strategy": "ddp"})."""
    return dataclasses.replace(cfg, **{g: dataclasses.replace(getattr(cfg, g), **kv) for g, kv in groups.items()})


def test_topology_and_batch_math():
    plan = build(llama7b_zero3_h100())
    assert plan.world_size == 8
    assert (plan.dims.dp_shard, plan.dims.dp, plan.dims.tp) == (8, 8, 1)
    assert plan.batch.tokens_per_step == 64 * 4096
    assert plan.batch.tokens_total == 64 * 4096 * 1000
    assert (plan.batch.micro_batch, plan.batch.grad_accum, plan.batch.dp) == (2, 4, 8)


def test_params_and_flops_of_llama2_7b():
    plan = build(llama7b_zero3_h100())
    assert plan.params_total == P_7B
    assert plan.params_per_mp_rank == P_7B
    # 6 x matmul params + 12 x layers x dim x seq: matmul params leave out norms and the embedding lookup,
    # 32 x (4 x 4096^2 + 3 x 4096 x 11008) + 32000 x 4096 = 6,607,077,376.
    expected = 6 * 6_607_077_376 + 12 * 32 * 4096 * 4096
    assert plan.flops_per_token == pytest.approx(expected)
    assert plan.flops_per_step == pytest.approx(expected * 64 * 4096)


def test_step_time_is_compute_at_the_assumed_mfu_when_nothing_else_costs():
    plan = build(llama7b_zero3_h100(activation_checkpointing="none"))
    assert plan.peak_flops_per_device == pytest.approx(989.4e12)
    assert plan.assumed_mfu == DEFAULT_MFU == 0.4
    # 8192 tokens per micro-batch (full speed), no checkpointing, no pipeline, FSDP traffic hidden behind compute.
    assert plan.step_time_s == pytest.approx(plan.flops_per_step / (8 * 989.4e12 * DEFAULT_MFU))
    t = plan.throughput()
    assert t["time_to_tokens_s"] == pytest.approx(1000 * plan.step_time_s)
    assert t["gpu_hours"] == pytest.approx(8 * 1000 * plan.step_time_s / 3600)
    assert t["attention_flops_causal_per_token"] == pytest.approx(6 * 32 * 4096 * 4096)  # half of 12 L d s


def test_assumed_mfu_is_configurable():
    plan = build(replace(llama7b_zero3_h100(activation_checkpointing="none"), cluster={"assumed_mfu": 0.5}))
    assert plan.step_time_s == pytest.approx(plan.flops_per_step / (8 * 989.4e12 * 0.5))


def test_full_checkpointing_adds_a_forward_of_the_blocks():
    plain = build(llama7b_zero3_h100(activation_checkpointing="none")).step_time
    full = build(llama7b_zero3_h100()).step_time
    block_forward = 2 * (BLOCK_7B - 2 * 4096) + 4 * 4096 * 4096
    # at RECOMPUTE_SPEEDUP times the step's rate (measured on NVIDIA H200: plan/throughput.py)
    assert full.recompute_s / plain.compute_s == pytest.approx(
        32 * block_forward / plain_flops_per_token() / RECOMPUTE_SPEEDUP)


def test_memory_of_zero3_on_8_ranks_fits_without_warning():
    plan = build(llama7b_zero3_h100(), machine=EIGHT_H100)  # as the llama7b_fsdp recipe
    assert plan.memory.params + plan.memory.grads == 8 * P_7B // 8
    assert plan.fit.verdict == "fits" and plan.fit.headroom_bytes > 0.1 * plan.fit.capacity_bytes
    assert plan.warnings == () and plan.advice == ()
    assert refusal(plan) is None


def test_zero3_7b_without_checkpointing_does_not_fit_8k_tokens_per_h100():
    # ~5.5 MB of bf16 activations per token over 32 blocks x 8192 tokens (CUDA's fused RMSNorm keeps its fp32
    # input and rstd): ~42 GiB on top of the states.
    plan = build(llama7b_zero3_h100(activation_checkpointing="none"))
    assert plan.fit.verdict == "does not fit"
    assert plan.memory.activations > 40 * 2**30


def test_tensor_parallel_splits_params_per_rank():
    plan = build(replace(llama7b_zero3_h100(global_batch=32, grad_accum=4), sharding={"dp_shard": 4, "tp": 2}))
    norms = 65 * 4096  # replicated on both tp ranks
    assert plan.params_per_mp_rank == (P_7B - norms) // 2 + norms
    assert plan.dims.dp == 4


def test_ddp_7b_on_h100_does_not_fit_and_says_what_would():
    cfg = replace(llama7b_zero3_h100(), sharding={"strategy": "ddp", "dp_shard": 1, "dp_replicate": 8})
    plan = build(cfg, machine=EIGHT_H100)
    (warning,) = plan.warnings
    assert "does not fit" in warning and "h100" in warning
    assert plan.fit.verdict == "does not fit" and plan.fit.headroom_bytes < 0
    assert plan.advice and plan.advice[0].verdict == "fits"
    line = refusal(plan)
    assert line.startswith("does not fit") and "\n" not in line and "--force" in line
    assert " ".join(plan.advice[0].overrides) in line


def test_batch_mismatch_is_warned():
    (warning,) = build(llama7b_zero3_h100(global_batch=60), machine=EIGHT_H100).warnings
    assert "train.global_batch=60" in warning and "64" in warning


def test_unknown_gpu_is_warned_and_gives_no_throughput():
    plan = build(replace(llama7b_zero3_h100(), cluster={"gpu": ""}))
    assert plan.peak_flops_per_device is None and plan.step_time_s is None
    assert any("cluster.gpu" in w for w in plan.warnings)


def test_cpu_run_on_slurm_has_no_peak_and_no_verdict():
    base = llama7b_zero3_h100()
    keys = {**dataclasses.asdict(base.cluster), "device": "cpu", "gpu": "", "launcher": "slurm"}
    cluster = SlurmClusterConfig(**keys)
    cfg = dataclasses.replace(base, cluster=cluster)
    plan = build(cfg)
    assert plan.peak_flops_per_device is None and plan.step_time_s is None
    assert plan.fit.verdict == "unknown" and plan.fit.capacity_bytes is None
    assert plan.warnings == ()


@pytest.mark.parametrize(
    "groups",
    [{"sharding": {"dp_shard": -1}}, {"train": {"grad_accum": -1}}, {"sharding": {"dp_shard": 4}}],
    ids=["unresolved-degree", "unresolved-batch", "degrees-not-world"],
)
def test_unresolved_or_inconsistent_config_raises_plan_error(groups):
    with pytest.raises(PlanError):
        build(replace(llama7b_zero3_h100(), **groups))


def test_launch_command_is_local_torchrun_on_the_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    plan = SimpleNamespace(**command_record(llama7b_zero3_h100().cluster, run_dir))
    argv = list(plan.launch_argv)
    assert argv[1:3] == ["-m", "torch.distributed.run"]
    for arg in ("--standalone", "--nnodes=1", "--nproc_per_node=8", "--max_restarts=0"):
        assert arg in argv
    assert argv[-3:] == ["-m", "trainctl.train", str(run_dir)]
    assert plan.launch_command.endswith(f"-m trainctl.train {run_dir}")


def test_with_run_dir_repoints_the_command():
    cfg = llama7b_zero3_h100()
    plan = SimpleNamespace(**plan_record(build(cfg), cfg, Path("/runs/x")))
    assert plan.launch_argv[-1] == "/runs/x"
    assert "/runs/x" in plan.launch_command


def test_to_dict_is_json_serializable_and_complete():
    cfg = llama7b_zero3_h100()
    plan = build(cfg)
    data = json.loads(json.dumps(plan_record(plan, cfg)))
    assert data["params_total"] == P_7B
    assert data["model"] == f"llama ({cfg.model.name}): 32 layers x 4096, 32/32 heads, vocab 32000"
    assert data["dims"]["dp"] == 8
    assert data["batch"]["tokens_per_step"] == 64 * 4096
    assert data["memory"]["peak_bytes"] == plan.memory.peak
    assert data["memory"]["verdict"] == plan.fit.verdict
    assert len(data["memory"]["per_pp_rank"]) == 1
    assert data["throughput"]["step_time_s"] == plan.step_time_s
    assert isinstance(data["notes"], list) and data["notes"]
    assert data["launch_argv"] == launch_argv(cfg.cluster, default_run_dir(cfg))
