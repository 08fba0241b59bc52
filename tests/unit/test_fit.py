"""Device kinds, the framework allowance, verdicts, the advice's ranking and the throughput model's parts."""

from __future__ import annotations

import dataclasses

import pytest

from tests.helpers import LLAMA2_7B
from trainctl.config.errors import ConfigError
from trainctl.config.schema import ClusterConfig, PrecisionConfig, RunConfig, ShardingConfig, TrainConfig
from trainctl.config.slurm import SlurmClusterConfig
from trainctl.config.validate import resolve
from trainctl.core.dims import ParallelDims
from trainctl.core.gpus import GPUS, match_gpu, peak_flops
from trainctl.plan import fit, throughput
from trainctl.plan.advice import VERDICT_ORDER
from trainctl.plan.runplan import build

GIB = 2**30


@pytest.mark.parametrize(
    "kind, memory_gib, bf16_tflops",
    [
        ("h100_sxm", 79.6, 989.4),
        ("h100_pcie", 79.6, 756.0),
        ("h200", 140.4, 989.4),
        ("a100_80gb", 80.0, 312.0),
        ("a100_40gb", 40.0, 312.0),
    ],
)
def test_device_table_has_memory_and_peaks(kind, memory_gib, bf16_tflops):
    spec = GPUS[kind]
    assert spec.memory_gib == memory_gib
    assert peak_flops(kind, "bf16") == bf16_tflops * 1e12
    assert peak_flops(kind, "fp32") == spec.peak_tflops["fp32"] * 1e12 < peak_flops(kind, "bf16")
    assert spec.intra_gbs > spec.inter_gbs > 0


def test_earlier_names_stay_valid_aliases():
    assert GPUS["h100"] is GPUS["h100_sxm"] and GPUS["a100"] is GPUS["a100_80gb"]
    assert match_gpu("NVIDIA H100 80GB HBM3") == "h100_sxm"
    assert match_gpu("NVIDIA A100-SXM4-40GB") == "a100_40gb"
    assert match_gpu("NVIDIA H200") == "h200"


def test_validate_accepts_the_new_kinds_and_names_them_when_wrong():
    base = RunConfig(cluster=ClusterConfig(device="cuda", gpu="h200"), train=TrainConfig(global_batch=-1))
    assert resolve(base).cluster.gpu == "h200"
    with pytest.raises(ConfigError) as err:
        resolve(dataclasses.replace(base, cluster=ClusterConfig(device="cuda", gpu="h300")))
    assert "a100_40gb" in str(err.value) and "h100_pcie" in str(err.value)
    with pytest.raises(ConfigError) as err:
        resolve(dataclasses.replace(base, cluster=ClusterConfig(assumed_mfu=1.5)))
    assert "cluster.assumed_mfu=1.5" in str(err.value)


def test_cpu_capacity_is_this_machines_memory_per_local_worker_and_unknown_on_slurm():
    host = fit.host_memory_bytes()
    assert host and fit.capacity_bytes(ClusterConfig(device="cpu", procs_per_node=2)) == host // 2
    assert fit.capacity_bytes(SlurmClusterConfig(device="cpu")) is None
    assert fit.capacity_bytes(ClusterConfig(device="cuda", gpu="a100_40gb")) == 40 * GIB
    assert fit.capacity_bytes(ClusterConfig(device="cuda", gpu="")) is None


def test_framework_allowance_counts_context_nccl_dims_and_fragmentation():
    dims = ParallelDims(dp_shard=4, tp=2)  # two parallel dims
    assert fit.framework_bytes(40 * GIB, "cuda", dims) == int(0.75 * GIB) + 2 * int(0.25 * GIB) + 4 * GIB
    assert fit.framework_bytes(40 * GIB, "cpu", dims) == int(0.5 * GIB)


@pytest.mark.parametrize(
    "need_gib, verdict",
    [(70.0, "fits"), (72.0, "fits"), (72.1, "tight"), (80.0, "tight"), (80.1, "does not fit")],
)
def test_verdict_thresholds_at_ten_percent_headroom(need_gib, verdict):
    capacity = 80 * GIB
    assert fit.verdict(capacity - int(need_gib * GIB), capacity) == verdict


def ddp_7b() -> RunConfig:
    return RunConfig(
        model=LLAMA2_7B,
        precision=PrecisionConfig(compute_dtype="bf16"),
        sharding=ShardingConfig(strategy="ddp", dp_replicate=8),
        cluster=ClusterConfig(procs_per_node=8, device="cuda", gpu="h100_sxm"),
        train=TrainConfig(steps=100, seq_len=4096, global_batch=64, micro_batch=2, grad_accum=4),
    )


def test_advice_ranks_fitting_changes_first_cheapest_first_each_with_its_figures():
    plan = build(ddp_7b())
    assert plan.fit.verdict == "does not fit"
    advice = list(plan.advice)
    assert advice and all(a.need_bytes < plan.fit.need_bytes for a in advice)
    groups = [VERDICT_ORDER[a.verdict] <= 1 for a in advice]
    assert groups == sorted(groups, reverse=True)  # fitting ones before the others
    order = [(VERDICT_ORDER[a.verdict], a.slowdown) for a in advice if VERDICT_ORDER[a.verdict] <= 1]
    assert order and order == sorted(order)  # fits before tight, cheapest first
    assert any(a.overrides == ("sharding=zero3",) for a in advice)  # a higher ZeRO stage over the same 8 ranks
    for a in advice:
        assert a.peak_bytes > 0 and a.step_time_s > 0 and a.slowdown is not None


def test_advice_costs_follow_the_throughput_model():
    by_change = {a.overrides[0]: a for a in build(ddp_7b()).advice}
    full = by_change.get("train.activation_checkpointing=full")
    assert full is not None and 0.2 < full.slowdown < 0.4  # about a third more forward work in the blocks


def test_micro_batch_efficiency_and_bubble_and_recompute():
    assert throughput.micro_batch_efficiency(8192) == 1.0
    assert throughput.micro_batch_efficiency(4096) == pytest.approx(0.95)
    assert throughput.micro_batch_efficiency(2048) == pytest.approx(0.95**2)
    assert throughput.bubble_fraction("1f1b", pp=4, micro_batches=8, stages_per_rank=1) == pytest.approx(3 / 8)
    assert throughput.bubble_fraction("interleaved_1f1b", pp=4, micro_batches=8, stages_per_rank=2) == pytest.approx(
        3 / 16
    )
    assert throughput.bubble_fraction("gpipe", pp=1, micro_batches=8, stages_per_rank=1) == 0
    assert throughput.recompute_flops_per_token(LLAMA2_7B, 4096, "op", 32) == 0
    assert throughput.recompute_flops_per_token(LLAMA2_7B, 4096, "full", 2) == 2 * throughput.recompute_flops_per_token(
        LLAMA2_7B, 4096, "full", 1
    )
