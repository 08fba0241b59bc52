"""A tiny mixture of experts trained under expert parallelism: the same 10-step curve as one process.

qwen3_moe (and mixtral under ep=2) with 4 experts, 2 per token (the Qwen3-MoE router), fp32, no auxiliary loss: one process on the global
batch of 8, and the same batch under ep=2 with full activation checkpointing (FSDP2 over dp_shard=2, each rank
holding 2 experts; the all-to-alls run again in the recomputed forward), and ep=2 x FSDP2 2 (4 ranks: dp_shard=4
split into [efsdp=2, ep=2], each expert's weights sharded over 2 ranks), and ep=2 x TP 2 (4 ranks, the experts
replicated over tp, each tp rank exchanging its sequence shard with its ep peer; qwen3_moe and mixtral). Only the order of the sums differs (the
experts' gradients are summed across ranks by the all-to-all's backward and FSDP2's reduce-scatter), so the curves
agree to fp32 rounding (tests.helpers.curve_rel).

The load-balancing loss is a product of two batch means, so any data-parallel layout computes it per rank's
micro-batch, not over the global batch: with it on, ep=2 is compared with FSDP2 over the same 2 ranks (ep=1),
which routes the same tokens per rank. Pipeline stages (pp=2, 1f1b, one layer each) on one data-parallel rank
accumulate the same micro-batches of 4 sequences: each stage backpropagates its own layer's auxiliary loss
(train/parallel/stage_aux.py), so the curve, the aux loss and the load are FSDP2's over 2 ranks; mixtral under pp=2
(without the aux loss) is its one-process curve; so is ep=2 x pp=2 (1f1b, 4 ranks: each stage's ep group
inside it). Stop and resume under ep=2 is bitwise the straight run, and its checkpoint
resumes under ep=1 (FSDP2 alone) with the same data order and the same steps to rounding; under ep=2 x tp=2 too
it is bitwise the straight run. LoRA on attention and on
the experts (one adapter per expert, split with its expert) under ep=2 and under FSDP2 over 2 ranks follows its
one-process curve.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_resume import launch, losses, ok, stopped_and_resumed_equals_straight
from worker_runs import base_config, records, runs_read, series, train_many, write_run_dir

from tests.helpers import assert_curve_close, curve_rel
from trainctl.config.schema import CheckpointConfig, LoRAConfig, ModelConfig, MoEConfig, ShardingConfig
from trainctl.train.checkpoint.store import list_committed

pytestmark = pytest.mark.dist

STEPS = 10
MOE = ModelConfig(name="moe", family="qwen3_moe", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                  ffn_dim=128, vocab_size=256, max_seq_len=64,
                  moe=MoEConfig(num_experts=4, experts_per_token=2, expert_ffn_dim=64, aux_loss_coef=0.0))
AUX = replace(MOE, moe=replace(MOE.moe, aux_loss_coef=0.01))
MIXTRAL = replace(MOE, family="mixtral", head_dim=0, moe=replace(MOE.moe, router="topk_softmax"))
EP2 = ShardingConfig(strategy="zero3", dp_shard=2, ep=2)
LORA = replace(MOE, lora=LoRAConfig(rank=4, targets=["q", "v", "expert_gate_up", "expert_down"]))
EP2_TP2 = ShardingConfig(strategy="zero3", dp_shard=2, ep=2, tp=2)
PP2 = ShardingConfig(strategy="none", pp=2, pp_schedule="1f1b")


def config(cache, sharding: ShardingConfig, micro_batch: int, model: ModelConfig = MOE, **train):
    base = base_config(cache, **{"steps": STEPS, **train}, micro_batch=micro_batch)
    return replace(base, model=model, sharding=sharding)


# The runs each test reads ({name}: its parameter's): the module trains only those of its selected tests.
READS = {
    "test_expert_parallel_matches_one_process": ("single", "{name}"),
    "test_mixtral_under_ep_matches_one_process": ("single", "mixtral-single", "{name}"),
    "test_expert_parallel_with_the_aux_loss_matches_the_same_data_parallel_ranks": ("single", "aux-fsdp2", "aux-ep2"),
    "test_pipeline_stages_with_the_aux_loss_match_the_same_micro_batches": ("aux-fsdp2", "aux-pp2"),
    "test_pipeline_stages_log_every_layers_expert_load": ("aux-fsdp2", "aux-pp2"),
    "test_mixtral_under_pp_matches_one_process": ("mixtral-single", "mixtral-pp2"),
    "test_lora_on_the_experts_matches_one_process": ("single", "lora-single", "{name}"),
}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, data_cache):
    read = runs_read(request, READS)
    cases = {
        "single": (config(data_cache, ShardingConfig(), 8), None),
        "ep2_ac": (config(data_cache, EP2, 4, activation_checkpointing="full"), 2),
        "aux-fsdp2": (config(data_cache, replace(EP2, ep=1), 4, AUX), 2),
        "aux-ep2": (config(data_cache, EP2, 4, AUX), 2),
        "ep2_fsdp2": (config(data_cache, ShardingConfig(strategy="zero3", dp_shard=4, ep=2), 2), 4),
        "ep2_tp2": (config(data_cache, EP2_TP2, 4), 4),
        "mixtral-ep2_tp2": (config(data_cache, EP2_TP2, 4, MIXTRAL), 4),
        "mixtral-single": (config(data_cache, ShardingConfig(), 8, MIXTRAL), None),
        "mixtral-ep2": (config(data_cache, EP2, 4, MIXTRAL), 2),
        "aux-pp2": (config(data_cache, PP2, 4, AUX, grad_accum=2), 2),
        "ep2_pp2": (config(data_cache, replace(EP2, pp=2, pp_schedule="1f1b"), 2, grad_accum=2), 4),
        "mixtral-pp2": (config(data_cache, PP2, 4, MIXTRAL, grad_accum=2), 2),
        "lora-single": (config(data_cache, ShardingConfig(), 8, LORA), None),
        "lora-ep2": (config(data_cache, EP2, 4, LORA), 2),
        "lora-fsdp2": (config(data_cache, replace(EP2, ep=1), 4, LORA), 2),
    }
    return train_many(tmp_path_factory.mktemp("expert-parallel"), {k: v for k, v in cases.items() if k in read})


@pytest.mark.slow  # the fixture's 15 runs (3 torchruns, one of 4 ranks): 50-60 s on 2 cores
@pytest.mark.parity
@pytest.mark.parametrize("name", ["ep2_ac", "ep2_fsdp2", "ep2_tp2", "ep2_pp2"])
@pytest.mark.parametrize("key", ["loss", "grad_norm"])
def test_expert_parallel_matches_one_process(runs, name, key):
    want = series(runs["single"], key)
    assert len(want) == STEPS and len(set(want)) == STEPS
    assert_curve_close(series(runs[name], key), want, key, model=MOE)


@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.parametrize("key", ["loss", "grad_norm"])
@pytest.mark.parametrize("name", ["mixtral-ep2", "mixtral-ep2_tp2"])
def test_mixtral_under_ep_matches_one_process(runs, name, key):
    want = series(runs["mixtral-single"], key)
    assert len(set(want)) == STEPS and want != series(runs["single"], key)  # another model
    assert_curve_close(series(runs[name], key), want, key, model=MIXTRAL)


@pytest.mark.slow
@pytest.mark.parametrize("key", ["loss", "grad_norm"])
def test_expert_parallel_with_the_aux_loss_matches_the_same_data_parallel_ranks(runs, key):
    want = series(runs["aux-fsdp2"], key)
    assert len(set(want)) == STEPS and want != series(runs["single"], key)  # the aux loss is in the gradients
    assert_curve_close(series(runs["aux-ep2"], key), want, key, model=MOE)


@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.parametrize("key", ["loss", "grad_norm", "aux_loss"])
def test_pipeline_stages_with_the_aux_loss_match_the_same_micro_batches(runs, key):
    want = series(runs["aux-fsdp2"], key)
    assert len(set(want)) == STEPS
    assert_curve_close(series(runs["aux-pp2"], key), want, key, model=AUX)


@pytest.mark.slow
def test_pipeline_stages_log_every_layers_expert_load(runs):
    got, want = records(runs["aux-pp2"], "train"), records(runs["aux-fsdp2"], "train")
    # The first step routes with the same weights: the same counts; every step counts each routed token once.
    assert got[0]["expert_load"] == want[0]["expert_load"]
    slots = 8 * 64 * AUX.moe.experts_per_token  # base_config: 8 sequences of 64 tokens a step, k slots each
    assert all([sum(layer) for layer in r["expert_load"]] == [slots] * AUX.n_layers for r in got)


@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.parametrize("key", ["loss", "grad_norm"])
def test_mixtral_under_pp_matches_one_process(runs, key):
    assert_curve_close(series(runs["mixtral-pp2"], key), series(runs["mixtral-single"], key), key, model=MIXTRAL)


@pytest.mark.slow
def test_stop_and_resume_under_ep_is_bitwise_identical_and_resumes_onto_ep1(tmp_path, data_cache):
    def run(name: str, sharding: ShardingConfig = EP2, **checkpoint):
        cfg = config(data_cache, sharding, 4, AUX, steps=6, eval_every=6)
        return replace(cfg, name=name, checkpoint=CheckpointConfig(**checkpoint))

    straight, resumed = stopped_and_resumed_equals_straight(tmp_path, run, 2, stop_at=3, steps=6)
    # The step-3 checkpoint (experts saved as E/ep-row shards) loaded by FSDP2 alone over the same ranks: the same
    # data order, the same steps to rounding (resharding changes the order of the sums).
    source = dict(list_committed(resumed / "checkpoints"))[3]
    onto = write_run_dir(tmp_path, run("onto-ep1", replace(EP2, ep=1), resume=str(source), load_only="all"))
    ok(launch(onto, 2), onto)
    got, want = losses(onto), losses(straight)
    assert sorted(got) == [4, 5, 6]
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=curve_rel(step, model=MOE)), step


@pytest.mark.slow  # its own 3 launches of 4 ranks: 60-90 s on 2 cores
def test_stop_and_resume_under_ep_and_tp_is_bitwise_identical(tmp_path, data_cache):
    # The experts as 2-D (ep, tp) DTensors through DCP: saved and loaded onto the same layout, every loss and the
    # final weights bitwise the straight run's.
    def run(name: str):
        return replace(config(data_cache, EP2_TP2, 4, steps=6, eval_every=6), name=name)

    stopped_and_resumed_equals_straight(tmp_path, run, 4, stop_at=3, steps=6)


@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.parametrize("name", ["lora-ep2", "lora-fsdp2"])
@pytest.mark.parametrize("key", ["loss", "grad_norm"])
def test_lora_on_the_experts_matches_one_process(runs, name, key):
    want = series(runs["lora-single"], key)
    assert len(set(want)) == STEPS and want != series(runs["single"], key)  # the adapters, not the base, learn
    assert_curve_close(series(runs[name], key), want, key, model=LORA)
