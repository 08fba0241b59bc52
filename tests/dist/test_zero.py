"""ZeRO stages, CPU offload and activation memory options on two ranks: same training curve as one
process, and the per-rank model-state bytes the ZeRO arithmetic promises (and the plan estimates).

Every run logs one `kind: memory` record after its first optimizer step, before zero_grad
(trainctl.train.observe.memory_stats): bytes of the LOCAL parameters, gradients and optimizer states
of each rank. Expected per rank, with P parameters, fp32, AdamW, dp = 2:

    strategy   params   grads   optimizer
    none, ddp  4P       4P      8P
    zero1      4P       4P      8P/2 up to ZeroRedundancyOptimizer's whole-tensor partition
    zero2      4P/2     4P/2    8P/2   (FSDP2 reshards after backward: between steps only shards)
    zero3      4P/2     4P/2    8P/2

Tolerances, stated once: the optimizer also stores AdamW's scalar `step` per parameter tensor
(4 bytes each); a FSDP2 shard of a tensor whose dim 0 is odd is one row larger on some ranks
(none of the test model's are: the shards come out exact); zero1 assigns whole tensors to ranks,
so its busiest rank may hold up to one largest tensor's states more than 8P/2.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from worker_runs import TINY, base_config, records, series, train_many

from tests.helpers import assert_curve_close
from trainctl.config.schema import ShardingConfig
from trainctl.core.dims import ParallelDims
from trainctl.models.build import build_model
from trainctl.plan import rank_states
from trainctl.plan.flops import param_count
from trainctl.plan.stages import rank_stages

pytestmark = pytest.mark.dist

STEPS = 10
P = param_count(TINY)
PARAMS = list(build_model(TINY, "meta").parameters())
STEP_BYTES = 4 * len(PARAMS)  # AdamW's scalar step counter, one per parameter tensor
LARGEST = max(p.numel() for p in PARAMS)
ROW_SLACK = sum(4 * p.numel() // p.shape[0] for p in PARAMS)  # fp32 bytes of one dim-0 row per tensor

SHARDING = {
    "none": ShardingConfig(),
    "zero1": ShardingConfig(strategy="zero1", dp_replicate=2),
    "ddp": ShardingConfig(strategy="ddp", dp_replicate=2),
    "zero2": ShardingConfig(strategy="zero2", dp_shard=2),
    "zero3": ShardingConfig(strategy="zero3", dp_shard=2, cpu_offload=True),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    """The single-process reference and four 2-rank runs over the same global batch of 8.

    ddp also runs op-level checkpointing with activation offload and 2 accumulation steps, and
    zero3 offloads to CPU: each run checks its options' parity and its strategy's memory at once. The four
    2-rank runs train in one torchrun; the memory records count tensors' bytes, not the process's, so an earlier
    run in the same process does not change them.
    """
    root = tmp_path_factory.mktemp("zero")
    configs = {
        "none": (base_config(data_cache, steps=STEPS), None),
        "zero1": (base_config(data_cache, steps=STEPS, micro_batch=4), 2),
        "ddp": (base_config(data_cache, steps=STEPS, micro_batch=2, grad_accum=2, activation_checkpointing="op", activation_offload=True), 2),
        "zero2": (base_config(data_cache, steps=STEPS, micro_batch=4, activation_checkpointing="selective", ac_every=2), 2),
        "zero3": (base_config(data_cache, steps=STEPS, micro_batch=4), 2),
    }
    return train_many(root, {name: (replace(cfg, sharding=SHARDING[name]), nproc) for name, (cfg, nproc) in configs.items()})


def memory(run_dir) -> dict:
    (record,) = records(run_dir, "memory")
    return record


@pytest.mark.parametrize("name", ["zero1", "ddp", "zero2", "zero3"])
@pytest.mark.parametrize("key", ["loss", "grad_norm"])
def test_first_steps_match_one_process(runs, name, key):
    got, want = series(runs[name], key), series(runs["none"], key)
    assert len(got) == len(want) == STEPS
    assert_curve_close(got, want, key)


def per_rank(runs, name: str, key: str) -> list[int]:
    return [r[key] for r in memory(runs[name])["per_rank"]]


@pytest.mark.parametrize("name,ranks", [("none", 1), ("ddp", 2), ("zero1", 2)])
def test_replicated_strategies_keep_whole_params_and_grads(runs, name, ranks):
    assert per_rank(runs, name, "params_bytes") == [4 * P] * ranks
    assert per_rank(runs, name, "grads_bytes") == [4 * P] * ranks


@pytest.mark.parametrize("name", ["none", "ddp"])
def test_unsharded_optimizer_holds_8_bytes_per_param(runs, name):
    for got in per_rank(runs, name, "optimizer_bytes"):
        assert got == 8 * P + STEP_BYTES


def test_zero1_splits_the_optimizer_states_by_whole_tensors(runs):
    shards = per_rank(runs, "zero1", "optimizer_bytes")
    assert sum(shards) == 8 * P + STEP_BYTES  # each state on exactly one rank
    for got in shards:
        assert 0 < got <= 8 * P / 2 + 8 * LARGEST / 2 + STEP_BYTES, shards


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_fsdp_strategies_keep_half_of_every_state(runs, name):
    for key, per_param in (("params_bytes", 4), ("grads_bytes", 4), ("optimizer_bytes", 8)):
        for got in per_rank(runs, name, key):
            slack = ROW_SLACK * per_param // 4 + (STEP_BYTES if key == "optimizer_bytes" else 0)
            assert per_param * P // 2 <= got <= per_param * P // 2 + slack, (key, got)


def test_cpu_offload_keeps_the_states_in_host_memory(runs):
    record = memory(runs["zero3"])
    assert record["host_bytes"] == record["params_bytes"] + record["grads_bytes"] + record["optimizer_bytes"]


def planned_states(name: str) -> list[dict]:
    """The plan's per-rank parameter, gradient and optimizer bytes (tensor by tensor, trainctl/plan/memory.py)."""
    sharding = SHARDING[name]
    dims = ParallelDims(dp_replicate=sharding.dp_replicate, dp_shard=sharding.dp_shard)
    (stage,) = rank_stages(TINY, sharding, 1)
    return [rank_states.model_states(TINY, sharding, dims, stage, rank) for rank in range(dims.dp)]


# The plan counts what each rank's tensors hold after backward: FSDP2's chunk of every tensor
# (zero2 included: it reshards after backward), ZeroRedundancyOptimizer's whole-tensor partition,
# AdamW's step counters. So it must agree exactly, rank by rank.
@pytest.mark.parametrize("name", ["none", "ddp", "zero1", "zero2", "zero3"])
def test_plan_estimate_agrees_with_measured(runs, name):
    planned = planned_states(name)
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert per_rank(runs, name, key) == [p[key] for p in planned], key
