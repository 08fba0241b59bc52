"""Tensor (+ sequence) parallelism alone and under FSDP2 / DDP: same losses and grad norms as one process.

Near-exact, not bitwise: TP splits the matmuls, so row-parallel partial sums (wo, w2, the
embedding) are added by a collective in a different order than one process's single matmul,
and the grad norm is summed shard by shard. Everything else (data, init, loss normalization)
is identical, so fp32 runs agree to rounding: tests.helpers.curve_rel's bound, the same under every torch
release and CPU (torch 2.11's tp2 drifts to 1.3e-5 by step 10, within it). A real mistake (a missing
gradient reduction, a wrong RoPE position, a mis-sliced init) is off by tens of percent at step 1.

A mixture of experts (qwen3_moe) under tp2 keeps its router and experts whole on each rank and routes each rank's
sequence shard: with the aux loss and the routing-bias update on, the curve, the aux loss and the expert load
equal one process's (a router or expert gradient left unsummed over tp is off by ~1e-4 at step 1).
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from worker_runs import TINY, base_config, records, selected_functions, series, train_many

from tests.helpers import assert_curve_close, curve_rel
from trainctl.config.schema import ModelConfig, MoEConfig, OptimConfig, ShardingConfig

pytestmark = pytest.mark.dist

STEPS = 10


# Families whose blocks hold more than llama's: qwen2's q/k/v biases (split with their rows), qwen3's per-head
# q/k norms (replicated weights fed by each rank's own heads: their gradients must be summed over tp).
FAMILIES = {"qwen2": dict(family="qwen2"), "qwen3": dict(family="qwen3", head_dim=32)}
# SGD's momentum buffer starts as a copy of the first gradient: the norms' tp partial sums must be reduced before
# the step (torch 2.11's multi-tensor SGD otherwise moves the replicated norm weights by unreduced sums).
SGD = OptimConfig(name="sgd", lr=1e-2, momentum=0.9, nesterov=True, grad_clip=1.0)
# A mixture of experts under tp: the experts and router replicated over tp, each rank routing its own sequence shard.
# The auxiliary loss and the aux-loss-free bias are on: both need the tp ranks' routed counts summed (one process
# routes the whole micro-batch), and the router's and experts' gradients summed over tp (Partial, as the norms').
MOE = ModelConfig(name="moe", family="qwen3_moe", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                  ffn_dim=128, vocab_size=256, max_seq_len=64,
                  moe=MoEConfig(num_experts=4, experts_per_token=2, expert_ffn_dim=64, aux_loss_coef=0.01,
                                bias_update_rate=0.01))


# The run groups each test reads (the "layouts" group: single, tp2, fsdp2_tp2, ddp2_tp2): the module trains only
# the groups its selected tests need (the torch 2.11 tier selects a few).
GROUPS_READ = {
    "test_tensor_parallel_matches_one_process": "layouts", "test_eval_loss_matches": "layouts",
    "test_weights_are_really_split": "layouts", "test_each_familys_tensor_parallel_plan_matches_one_process": "families",
    "test_sgd_momentum_under_tensor_parallel_matches_one_process": "sgd",
    "test_a_mixture_of_experts_under_tensor_parallel_matches_one_process": "moe",
    "test_a_mixture_of_experts_under_tensor_parallel_routes_every_token_once_as_one_process": "moe",
    "test_the_plan_counts_the_experts_replicated_over_tp": "moe",
}


@pytest.fixture(scope="module")
def all_runs(request, tmp_path_factory, data_cache):
    """One process on the global batch of 8, and the same batch under tp2, fsdp2 x tp2, ddp2 x tp2 (accumulating);
    per family, one process and tp2 over 4 steps. The runs of one world size train in one torchrun; only the groups
    of the selected tests train."""
    by_group = {"layouts": {
        "single": (base_config(data_cache, steps=STEPS, micro_batch=8), ShardingConfig(), None),
        "tp2": (base_config(data_cache, steps=STEPS, micro_batch=8), ShardingConfig(tp=2), 2),
        "fsdp2_tp2": (base_config(data_cache, steps=STEPS, micro_batch=4),
                      ShardingConfig(strategy="fsdp", dp_shard=2, tp=2), 4),
        "ddp2_tp2": (base_config(data_cache, steps=STEPS, micro_batch=2, grad_accum=2),
                     ShardingConfig(strategy="ddp", dp_replicate=2, tp=2), 4),
    }, "families": {}}
    for family, model in FAMILIES.items():
        cfg = base_config(data_cache, steps=4, micro_batch=8)
        cfg = replace(cfg, model=replace(cfg.model, **model))
        by_group["families"] |= {f"{family}-single": (cfg, ShardingConfig(), None),
                                 f"{family}-tp2": (cfg, ShardingConfig(tp=2), 2)}
    sgd = replace(base_config(data_cache, steps=4, micro_batch=8), optim=SGD)
    moe = replace(base_config(data_cache, steps=STEPS, micro_batch=8), model=MOE)
    # tp2 also recomputes every block (the aux loss's all-reduce over tp runs again in the backward)
    moe_ac = replace(moe, train=replace(moe.train, activation_checkpointing="full"))
    by_group["moe"] = {"moe-single": (moe, ShardingConfig(), None), "moe-tp2": (moe_ac, ShardingConfig(tp=2), 2)}
    by_group["sgd"] = {"sgd-single": (sgd, ShardingConfig(), None), "sgd-tp2": (sgd, ShardingConfig(tp=2), 2)}
    groups = {GROUPS_READ[name] for name in selected_functions(request)}
    configs = {name: case for group in by_group if group in groups for name, case in by_group[group].items()}
    return train_many(tmp_path_factory.mktemp("tensor-parallel"),
                      {name: (replace(cfg, sharding=sharding), nproc) for name, (cfg, sharding, nproc) in configs.items()})


@pytest.fixture(scope="module")
def runs(all_runs):
    return {name: all_runs[name] for name in ("single", "tp2", "fsdp2_tp2", "ddp2_tp2")}


@pytest.mark.parametrize("name", ["tp2", "fsdp2_tp2", "ddp2_tp2"])
@pytest.mark.parametrize("key", ["loss", "grad_norm"])
def test_tensor_parallel_matches_one_process(runs, name, key):
    got, want = series(runs[name], key), series(runs["single"], key)
    assert len(got) == len(want) == STEPS
    assert_curve_close(got, want, key)


@pytest.mark.parametrize("name", ["tp2", "fsdp2_tp2"])
def test_eval_loss_matches(runs, name):
    # Same held-out samples where dp x micro_batch matches the reference's 8 (tp ranks share data).
    for got, want in zip(records(runs[name], "eval"), records(runs["single"], "eval"), strict=True):
        assert got["val_loss"] == pytest.approx(want["val_loss"], rel=curve_rel(want["step"])), want["step"]


def tp_split_elements(tp: int) -> tuple[int, int]:
    """(elements one tp rank holds, total) for TINY: every weight is split by tp except the RMSNorm weights."""
    m = TINY
    head_dim = m.dim // m.n_heads
    attention = 2 * m.dim * m.n_heads * head_dim + 2 * m.dim * m.n_kv_heads * head_dim
    block_matmuls = attention + 3 * m.dim * m.ffn_dim
    split = m.n_layers * block_matmuls + 2 * m.vocab_size * m.dim
    norms = (2 * m.n_layers + 1) * m.dim
    return split // tp + norms, split + norms


@pytest.mark.parametrize("name", ["tp2", "fsdp2_tp2", "ddp2_tp2"])
def test_weights_are_really_split(runs, name):
    # Guards the parity tests against a run that silently kept whole weights on every rank.
    local, total = tp_split_elements(2)
    for log in sorted((runs[name] / "logs").glob("rank*.log")):
        found = re.search(r"tensor parallel x2: this rank holds (\d+) of (\d+) parameter elements", log.read_text())
        assert found, log
        assert (int(found[1]), int(found[2])) == (local, total)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_runs(request, all_runs):
    return {name: all_runs[f"{request.param}-{name}"] for name in ("single", "tp2")}


@pytest.mark.parametrize("key", ["loss", "grad_norm"])
def test_each_familys_tensor_parallel_plan_matches_one_process(family_runs, key):
    got, want = series(family_runs["tp2"], key), series(family_runs["single"], key)
    assert len(got) == len(want) == 4
    assert_curve_close(got, want, key)


@pytest.mark.parametrize("key", ["loss", "grad_norm"])
def test_sgd_momentum_under_tensor_parallel_matches_one_process(all_runs, key):
    got, want = series(all_runs["sgd-tp2"], key), series(all_runs["sgd-single"], key)
    assert len(got) == len(want) == 4
    assert_curve_close(got, want, key)


@pytest.mark.parametrize("key", ["loss", "grad_norm", "aux_loss"])
def test_a_mixture_of_experts_under_tensor_parallel_matches_one_process(all_runs, key):
    got, want = series(all_runs["moe-tp2"], key), series(all_runs["moe-single"], key)
    assert len(got) == len(want) == STEPS and len(set(want)) == STEPS
    assert_curve_close(got, want, key, model=MOE)


def test_a_mixture_of_experts_under_tensor_parallel_routes_every_token_once_as_one_process(all_runs):
    # Each tp rank counts its own tokens; the step's sum counts each once: the same load as one process, which
    # the bias update (on here) feeds back into the next step's routing.
    got, want = series(all_runs["moe-tp2"], "expert_load"), series(all_runs["moe-single"], "expert_load")
    assert got == want and len({str(load) for load in want}) > 1
    assert all(sum(layer) == 8 * 64 * MOE.moe.experts_per_token for load in want for layer in load)


def test_the_plan_counts_the_experts_replicated_over_tp(all_runs):
    # The worker's own count of what a tp rank holds equals the plan's: attention split, experts and router whole.
    from trainctl.plan.shapes import stage_tensors, tp_local

    tensors = stage_tensors(MOE, range(MOE.n_layers), True, True)
    plan = (sum(tp_local(t, 2, MOE.family).numel for t in tensors), sum(t.numel for t in tensors))
    found = re.search(r"tensor parallel x2: this rank holds (\d+) of (\d+) parameter elements",
                      (all_runs["moe-tp2"] / "logs" / "rank0.log").read_text())
    assert found and (int(found[1]), int(found[2])) == plan
    moe = sum(t.numel for t in tensors if ".feed_forward." in t.name)  # the router and the experts
    assert moe > plan[1] // 2 and plan[0] >= moe  # most of the model, and every tp rank holds all of it
