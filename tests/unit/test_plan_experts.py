"""The plan's expert parallelism terms (plan/experts.py): what a rank holds of the experts, and the all-to-all."""

from __future__ import annotations

import pytest

from trainctl.config.compose import compose
from trainctl.config.schema import ModelConfig, MoEConfig
from trainctl.config.validate import resolve
from trainctl.core.dims import ParallelDims
from trainctl.core.tensors import Tensor
from trainctl.core.wrapping import wrapping
from trainctl.plan import runplan
from trainctl.plan.compare import compare
from trainctl.plan.experts import (
    all_to_all_bytes,
    ep_local,
    exchange_bytes_per_token,
    expert_params_per_layer,
    expert_share,
)

MOE = ModelConfig(family="qwen3_moe", dim=64, n_layers=4,
                  moe=MoEConfig(num_experts=8, experts_per_token=2, expert_ffn_dim=32))
GPU = ["cluster.device=cuda", "cluster.gpu=h100", "cluster.procs_per_node=4", "train.micro_batch=2"]
EXPERTS = ["model=qwen3_moe_tiny", "model.moe.num_experts=8"]


def share(strategy: str, dims: ParallelDims, m: ModelConfig = MOE, recompute: bool = False):
    return expert_share(m, dims, wrapping(strategy, dims), m.n_layers, tokens=512, compute_bytes=2,
                        micro_batches=1, recompute=recompute)


def test_expert_parameters_per_layer_are_e_times_three_swiglu_matrices():
    assert expert_params_per_layer(MOE) == 8 * 3 * 64 * 32
    assert share("zero3", ParallelDims(dp_shard=4), ModelConfig()) is None  # a dense model has none


def test_ep2_halves_the_experts_a_rank_gathers_and_computes():
    one, two = share("zero3", ParallelDims(dp_shard=4)), share("zero3", ParallelDims(dp_shard=4, ep=2))
    assert (one.experts_per_rank, two.experts_per_rank) == (8, 4)
    assert two.gathered_bytes * 2 == one.gathered_bytes == 2 * expert_params_per_layer(MOE)
    # ep x efsdp = dp_shard: the stored shard (weights, gradients, optimizer states) is FSDP2's over dp_shard
    assert two.stored_params == one.stored_params == 4 * expert_params_per_layer(MOE) // 4
    assert (two.params_bytes, two.grads_bytes) == (one.params_bytes, one.grads_bytes)
    assert two.optimizer_bytes == one.optimizer_bytes >= 2 * two.params_bytes  # AdamW: two fp32 moments


def test_ep_stores_a_quarter_of_what_a_replicated_rank_does():
    replicated = share("ddp", ParallelDims(dp_replicate=4))
    split = share("zero3", ParallelDims(dp_shard=4, ep=2))
    assert split.params_bytes * 4 == replicated.params_bytes
    assert split.optimizer_bytes * 4 <= replicated.optimizer_bytes + 64  # a per-tensor step counter at most


def test_all_to_all_volume_follows_the_routed_rows_that_leave_the_rank():
    assert share("zero3", ParallelDims(dp_shard=4)).all_to_all_bytes == 0
    # 512 tokens x 2 experts each, half of them to the other ep rank, dim 64 in bf16, 4 exchanges, 4 layers
    assert share("zero3", ParallelDims(dp_shard=4, ep=2)).all_to_all_bytes == 512 * 2 * 0.5 * 64 * 2 * 4 * 4
    # ep x tp: each tp rank exchanges its own sequence shard, half the micro-batch's tokens
    assert share("zero3", ParallelDims(dp_shard=2, ep=2, tp=2)).all_to_all_bytes == 256 * 2 * 0.5 * 64 * 2 * 4 * 4
    assert all_to_all_bytes(MOE, 512, 4, 4, 2, 1, False) == 512 * 2 * 0.75 * 64 * 2 * 4 * 4
    assert all_to_all_bytes(MOE, 512, 2, 4, 2, 3, True) == 512 * 2 * 0.5 * 64 * 2 * 6 * 4 * 3  # + recompute


def test_ep_local_splits_only_the_stacked_experts():
    experts, router = Tensor("layers.0.feed_forward.experts.w1", 8, 2048), Tensor("layers.0.feed_forward.router", 8, 64)
    assert ep_local(experts, 2).rows == 4 and ep_local(router, 2) == router and ep_local(experts, 1) == experts


def _plan(*overrides: str):
    return runplan.build(resolve(compose(["sharding=fsdp", *EXPERTS, *GPU, *overrides])),
                         with_advice=False)


def test_plan_reports_the_experts_and_adds_the_all_to_all_to_the_step():
    one, two = _plan(), _plan("sharding.ep=2")
    assert one.step_time.ep_comm_s == 0 and two.step_time.ep_comm_s > 0
    assert two.step_time.total_s == pytest.approx(one.step_time.total_s + two.step_time.ep_comm_s)
    data = two.to_dict()
    assert data["experts"]["experts_per_rank"] == 4 and data["experts"]["all_to_all_bytes"] > 0
    assert one.to_dict()["experts"]["all_to_all_bytes"] == 0
    assert [n for n in two.notes if n.startswith("experts (ep=2): each rank computes 4 of 8 experts")]
    assert not [n for n in one.notes if n.startswith("experts (ep")]


def test_compare_ep_lists_the_divisors_of_dp_shard():
    cfg = resolve(compose(["sharding=fsdp", *EXPERTS, *GPU]))
    rows = compare(cfg, "ep")
    assert [r["variant"] for r in rows] == ["(as configured)", "ep=2", "ep=4"]
    assert rows[1]["overrides"] == ["sharding.ep=2"] and rows[1]["slowdown"] > 0
    dense = resolve(compose(["sharding=fsdp", *GPU]))
    assert [r["variant"] for r in compare(dense, "ep")] == ["(as configured)"]  # validate refuses ep on it


def test_tune_tries_ep_for_a_mixture_of_experts_model_only():
    from trainctl.plan.tune import layouts

    moe = {v.cfg.sharding.ep for v in layouts(resolve(compose(["sharding=fsdp", *EXPERTS, *GPU])))}
    dense = {v.cfg.sharding.ep for v in layouts(resolve(compose(["sharding=fsdp", *GPU])))}
    assert moe == {1, 2, 4} and dense == {1}


def test_the_exchange_buffers_join_the_blocks_temporaries_under_ep_only():
    assert exchange_bytes_per_token(MOE, 1, 2) == 0 == exchange_bytes_per_token(ModelConfig(), 2, 2)
    assert exchange_bytes_per_token(MOE, 2, 2) == 2 * 2 * 64 * 2  # k rows of dim, arrived and regrouped, bf16
    one, two = _plan(), _plan("sharding.ep=2")  # fp32
    model = resolve(compose(["sharding=fsdp", *EXPERTS, *GPU])).model
    per_token = exchange_bytes_per_token(model, 2, 4)
    assert two.memory.grad_temp - one.memory.grad_temp == per_token * two.memory.tokens_per_micro_batch > 0


def test_the_dims_table_and_the_launch_summary_show_ep_beside_dp_shard():
    import io

    from rich.console import Console

    from trainctl.render import plan_summary, render_plan

    cfg = resolve(compose([*EXPERTS, "cluster.procs_per_node=4", "sharding=fsdp", "sharding.ep=2",
                           "train.micro_batch=2"]))
    data = runplan.build(cfg).to_dict()
    assert list(data["dims"]) == ["dp_replicate", "dp_shard", "ep", "cp", "tp", "pp", "dp"]
    assert (data["dims"]["dp_shard"], data["dims"]["ep"]) == (4, 2) and data["experts"]["experts_per_rank"] == 4
    out = io.StringIO()
    render_plan(Console(file=out, width=120), data)
    dims = out.getvalue().split("dims", 1)[1].split("batch", 1)[0]
    assert [line.split() for line in dims.splitlines() if "ep" in line.split()[:1]] == [["ep", "2"]]
    out = io.StringIO()
    plan_summary(Console(file=out, width=200), data)
    assert "zero3 (dp 4; experts split over ep 2)" in out.getvalue()


def test_the_plan_notes_that_tp_leaves_the_experts_whole():
    cfg = resolve(compose([*EXPERTS, "cluster.procs_per_node=2", "sharding=none", "sharding.tp=2"]))
    notes = runplan.build(cfg).notes
    assert [n for n in notes if n.startswith("experts (tp=2): the router and every expert are whole")], notes
    dense = runplan.build(resolve(compose(["cluster.procs_per_node=2", "sharding=none", "sharding.tp=2"]))).notes
    assert not [n for n in dense if n.startswith("experts")]


def test_under_ep_and_tp_the_plan_notes_the_ep_split_and_the_tp_replication():
    cfg = resolve(compose([*EXPERTS, "cluster.procs_per_node=4", "sharding=fsdp", "sharding.dp_shard=2",
                           "sharding.ep=2", "sharding.tp=2"]))
    notes = [n for n in runplan.build(cfg).notes if n.startswith("experts (")]
    assert len(notes) == 1 and notes[0].startswith("experts (ep=2): each rank computes 4 of 8 experts"), notes
    assert "replicated over tp=2" in notes[0]


def test_tune_tries_pipeline_stages_for_a_mixture_of_experts_model_with_and_without_ep():
    """MoE pipeline stages run (train/parallel/stage_aux.py), with ep too, so tune offers both."""
    from trainctl.plan.tune import layouts

    candidates = layouts(resolve(compose(["sharding=fsdp", *EXPERTS, *GPU])))
    found = {(v.cfg.sharding.pp, v.cfg.sharding.ep) for v in candidates}
    assert (2, 1) in found and (2, 2) in found


def test_ep_with_pipeline_stages_stores_the_stage_layers_experts_over_dp_shard():
    # ep 2 x pp 2 on 4 ranks: dp_shard=2 = ep, each stage 2 of the 4 layers; a rank stores E/ep experts of its layers
    dims = ParallelDims(dp_shard=2, ep=2, pp=2)
    staged = expert_share(MOE, dims, wrapping("zero3", dims), 2, tokens=512, compute_bytes=2, micro_batches=1,
                          recompute=False)
    assert staged.experts_per_rank == 4
    assert staged.stored_params == 2 * expert_params_per_layer(MOE) // 2
    assert staged.all_to_all_bytes == 512 * 2 * 0.5 * 64 * 2 * 4 * 2
