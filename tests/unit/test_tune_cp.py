"""Context parallelism as a `trainctl tune` axis (trainctl/plan/tune.py) and the planner's cp terms."""

from __future__ import annotations

import dataclasses

import pytest

from trainctl import api
from trainctl.core.dims import ParallelDims
from trainctl.core.gpus import GPUS
from trainctl.core.wrapping import fsdp_shards, replicas, wrapping
from trainctl.plan import throughput, tune
from trainctl.plan.assess import assess, dims_of
from trainctl.plan.rank_states import model_states
from trainctl.plan.stages import rank_stages

# tiny's model on 4 CUDA ranks of one node (planning only: nothing runs), 4 samples per micro-batch.
GPU4 = ["recipe=tiny_cpu", "cluster.device=cuda", "cluster.gpu=h100", "cluster.procs_per_node=4", "train.micro_batch=4"]


def four_gpus(seq_len: int, *more: str):
    return api.resolved([*GPU4, f"train.seq_len={seq_len}", *more])


def cps(cfg) -> set[int]:
    return {v.cfg.sharding.cp for v in tune.layouts(cfg)}


def test_cp_candidates_are_the_degrees_the_sequence_allows():
    assert cps(four_gpus(64)) == {1, 2, 4}  # 64 is a multiple of 2 x 2 and 2 x 4
    assert cps(four_gpus(68)) == {1, 2}  # 68 is not a multiple of 8: cp=4's load-balanced shards do not divide
    assert cps(four_gpus(66)) == {1}


def test_no_cp_on_one_rank_or_on_cpu():
    assert cps(four_gpus(64, "cluster.procs_per_node=1")) == {1}
    tiny = api.resolved(["recipe=tiny_cpu"])  # seq_len 256 on 2 workers: only the CPU device rules cp out
    assert cps(tiny) == {1} and tune.with_cp(tiny, 2) is None


def test_cp_candidates_keep_the_world_and_the_batch_and_skip_what_the_worker_lacks():
    cfg = four_gpus(64)
    found = [v for v in tune.layouts(cfg) if v.cfg.sharding.cp > 1]
    assert found
    for v in found:
        s, t = v.cfg.sharding, v.cfg.train
        assert s.dp_replicate * s.dp_shard * s.cp * s.tp * s.pp == 4
        assert t.micro_batch * t.grad_accum * s.dp_replicate * s.dp_shard == t.global_batch == cfg.train.global_batch
        assert s.pp == 1 and s.strategy != "zero1"  # cp with either is not implemented in the worker
        assert t.seq_len % (2 * s.cp) == 0


def test_cp_candidates_compose_to_their_layout():
    """Each cp layout is the recipe plus its overrides, validated as a launch validates it."""
    found = [v for v in tune.layouts(four_gpus(64)) if v.cfg.sharding.cp > 1]
    assert {v.cfg.sharding.cp for v in found} == {2, 4}
    sample = [v for v in found if len(v.overrides) <= 3] + found[::17]  # composing is ~0.15 s each
    for v in sample:
        composed = api.resolved([*GPU4, "train.seq_len=64", *v.overrides])
        assert tune.layout_key(composed) == tune.layout_key(v.cfg), v.overrides


def test_ring_attention_time_by_hand():
    cfg = tune.with_cp(four_gpus(64), 2).cfg  # ddp over 2 replicas x cp 2, fp32
    m, t = cfg.model, cfg.train
    assert cfg.sharding.cp == 2 and cfg.precision.compute_dtype == "fp32"
    tokens = t.micro_batch * 64 // 2  # this rank's half of each sequence
    kv = m.n_heads * (m.dim // m.n_heads)  # the worker repeats the kv heads up to n_heads for the ring
    per_micro_batch = 3 * 2 * m.n_layers * tokens * kv * 4 * (2 - 1)  # fwd gather of k, v; bwd again + grads
    assert throughput.cp_comm_bytes(tokens, kv, m.n_layers, 2, 4) == per_micro_batch
    step = assess(cfg, dims_of(cfg)).step
    assert step.cp_comm_s == pytest.approx(per_micro_batch * t.grad_accum / (GPUS["h100"].intra_gbs * 1e9))
    no_cp = assess(four_gpus(64), dims_of(four_gpus(64))).step
    assert no_cp.cp_comm_s == 0.0 and step.total_s > step.compute_s + step.cp_comm_s - 1e-12


def test_fsdp_shards_over_the_cp_ranks_too():
    """The worker's FSDP2 mesh is dp_shard x cp (dp_shard_cp): the cp ranks hold a shard each, as dp ranks do."""
    cfg = four_gpus(64, "sharding=zero3")
    m, s = cfg.model, cfg.sharding
    stage = rank_stages(m, s, cfg.train.grad_accum)[0]
    with_cp = model_states(m, dataclasses.replace(s, dp_shard=2, cp=2), ParallelDims(dp_shard=2, cp=2), stage, 0)
    four_shards = model_states(m, dataclasses.replace(s, dp_shard=4), ParallelDims(dp_shard=4), stage, 0)
    two_shards = model_states(m, dataclasses.replace(s, dp_shard=2), ParallelDims(dp_shard=2), stage, 0)
    assert with_cp == four_shards and with_cp["params_bytes"] < two_shards["params_bytes"]


def test_cp_ranks_join_data_parallelism_for_the_gradients():
    """cp ranks see different tokens of the same sequences: their gradients are averaged like data parallel ones."""
    dims = ParallelDims(dp_replicate=2, dp_shard=2, cp=2)
    assert replicas(wrapping("ddp", ParallelDims(dp_replicate=2, cp=2)), ParallelDims(dp_replicate=2, cp=2)) == 4
    assert (replicas(wrapping("hsdp", dims), dims), fsdp_shards(wrapping("hsdp", dims), dims)) == (2, 4)
    zero2 = ParallelDims(dp_shard=4, cp=2)
    assert (replicas(wrapping("zero2", zero2), zero2), fsdp_shards(wrapping("zero2", zero2), zero2)) == (1, 8)
