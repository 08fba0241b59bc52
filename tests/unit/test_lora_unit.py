"""LoRA without processes: config checks, the trainable count by formula (plan = live model), the plan's memory
for adapters only, the layer (frozen base, peft's init, merge) and the export's q/k row order for B."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers import LLAMA2_7B, assert_close_fp, forward_terms
from trainctl.config.compose import compose
from trainctl.config.errors import ConfigError
from trainctl.config.schema import LoRAConfig, ModelConfig, PrecisionConfig, ShardingConfig, TrainConfig
from trainctl.config.validate import resolve
from trainctl.core.dims import ParallelDims
from trainctl.core.errors import UserError
from trainctl.models.build import build_model
from trainctl.models.hf import to_hf
from trainctl.models.lora import LoRALinear, init_adapters, trainable_count
from trainctl.models.lora_export import check_mode, merge
from trainctl.plan import memory
from trainctl.plan.flops import lora_formula_count, param_count
from trainctl.plan.runplan import build as build_plan
from trainctl.plan.stages import rank_stages

ALL = ["q", "k", "v", "o", "gate", "up", "down"]
SMALL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=128, max_seq_len=64)


def _problems(overrides):
    with pytest.raises(ConfigError) as info:
        resolve(compose(["recipe=tiny_cpu", *overrides]))
    return info.value.problems


@pytest.mark.parametrize(("override", "key"), [
    ("model.lora.rank=-1", "model.lora.rank=-1"),
    ("model.lora.alpha=0", "model.lora.alpha=0.0"),
    ("model.lora.dropout=1.0", "model.lora.dropout=1.0"),
    ("model.lora.targets=[q,qkv]", "model.lora.targets=['q', 'qkv']: unknown qkv"),
    ("model.lora.targets=[q,q]", "model.lora.targets=['q', 'q']: names a projection twice"),
])
def test_bad_lora_keys_are_one_line_each(override, key):
    problems = _problems(["model.lora.rank=8", override])
    assert len(problems) == 1 and problems[0].startswith(key), problems


@pytest.mark.parametrize("override", ["sharding.tp=2", "sharding.pp=2", "precision=fp8"])
def test_lora_refuses_layouts_it_does_not_compose_with(override):
    extra = ["cluster.procs_per_node=2"] if "sharding" in override else ["cluster.device=cuda", "cluster.gpu=h100"]
    problems = _problems(["model.lora.rank=8", override, *extra])
    assert any(p.startswith("model.lora.rank=8: LoRA with") for p in problems), problems


def test_lora_off_by_default_and_composes_with_ddp_and_fsdp():
    assert compose(["recipe=tiny_cpu"]).model.lora.rank == 0
    for sharding in ("ddp", "fsdp", "zero1"):
        resolve(compose(["recipe=tiny_cpu", "model.lora.rank=8", f"sharding={sharding}", "cluster.procs_per_node=2"]))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("targets", [["q", "v"], ALL])
def test_trainable_count_is_the_formula_and_the_live_models(family, targets):
    extra = {"head_dim": 32} if family == "qwen3" else {}
    cfg = ModelConfig(family=family, **SMALL, **extra, lora=LoRAConfig(rank=4, targets=targets))
    model = build_model(cfg, "meta")
    head = extra.get("head_dim", 16)
    shapes = {"q": (64, 4 * head), "k": (64, 2 * head), "v": (64, 2 * head), "o": (4 * head, 64),
              "gate": (64, 96), "up": (64, 96), "down": (96, 64)}
    by_hand = 2 * sum(4 * (shapes[t][0] + shapes[t][1]) for t in targets)
    assert trainable_count(model) == lora_formula_count(cfg) == by_hand
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert frozen == param_count(cfg)  # every base weight frozen, none trainable


def test_plan_shows_the_trainable_count():
    plan = build_plan(resolve(compose(["recipe=tiny_cpu", "model.lora.rank=8", "model.lora.targets=[q,v]"])))
    assert plan.params_trainable == lora_formula_count(plan_cfg := compose(
        ["recipe=tiny_cpu", "model.lora.rank=8", "model.lora.targets=[q,v]"]).model) > 0
    assert plan.params_trainable < param_count(plan_cfg) // 10
    # the total is what the worker builds (base + adapters): on one rank, the busiest rank's count
    assert plan.params_total == param_count(plan_cfg) + plan.params_trainable == plan.params_per_mp_rank
    assert "LoRA rank 8" in plan.model
    assert any(note.startswith("LoRA (rank 8 on q,v)") and "upper bound" in note for note in plan.notes)


def test_export_needs_a_mode_for_lora_and_none_without():
    lora = ModelConfig(lora=LoRAConfig(rank=4))
    for cfg, mode, words in ((lora, None, "pass --merged"), (ModelConfig(), "merged", "--merged: this run has no")):
        with pytest.raises(UserError) as info:
            check_mode(cfg, mode)
        assert len(info.value.problems) == 1 and words in info.value.problems[0]
    check_mode(lora, "adapter")
    check_mode(ModelConfig(), None)


@pytest.mark.parametrize(("strategy", "degrees"), [("none", {}), ("ddp", {"dp_replicate": 4}),
                                                   ("zero3", {"dp_shard": 4})])
def test_plan_counts_gradients_and_adamw_for_the_adapters_only(strategy, degrees):
    lora = LoRAConfig(rank=16, targets=ALL)
    m = dataclasses.replace(LLAMA2_7B, lora=lora)
    train = TrainConfig(seq_len=4096, micro_batch=1, grad_accum=1, global_batch=8)
    sharding = ShardingConfig(strategy=strategy, **degrees)
    (stage,) = rank_stages(m, sharding, 1)[:1]
    est = memory.estimate(m, PrecisionConfig(), sharding, train, ParallelDims(**degrees), stage)
    shards = degrees.get("dp_shard", 1)
    adapters = lora_formula_count(m)
    assert est.grads == pytest.approx(4 * adapters / shards, rel=0.01)
    assert est.params == pytest.approx(4 * (param_count(LLAMA2_7B) + adapters) / shards, rel=0.01)
    steps = 4 * 32 * 14  # one step counter per adapter tensor: 7 targets x (A, B) x 32 layers
    assert est.optimizer == pytest.approx(8 * adapters / shards + steps, rel=0.01)
    assert est.ddp_buckets == (4 * adapters if strategy == "ddp" else 0)


def _lora_model(targets=ALL) -> torch.nn.Module:
    cfg = ModelConfig(**SMALL, lora=LoRAConfig(rank=4, alpha=8.0, targets=targets))
    model = build_model(cfg, "cpu")
    torch.manual_seed(0)
    model.init_weights()
    init_adapters(model)
    return model


def test_adapters_start_at_the_base_model_and_only_they_get_gradients():
    model = _lora_model()
    tokens = torch.randint(0, 128, (2, 16))
    base = build_model(dataclasses.replace(model.cfg, lora=LoRAConfig()), "cpu")
    base.load_state_dict({k: v for k, v in model.state_dict().items() if ".lora_" not in k})
    assert torch.equal(model(tokens), base(tokens))  # B = 0: no change until it trains
    wq = model.layers["0"].attention.wq
    assert isinstance(wq, LoRALinear) and wq.lora_a.abs().max() > 0 and wq.lora_b.abs().max() == 0
    model(tokens, targets=tokens).backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad and all(".lora_" in n for n in with_grad)


@pytest.mark.parity
def test_merge_equals_the_adapted_forward_and_b_follows_the_rotary_rows():
    model = _lora_model()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(std=0.1)
    state = model.state_dict()
    merged = merge(state, model.cfg.lora)
    assert all(".lora_" not in n for n in merged)
    plain = build_model(dataclasses.replace(model.cfg, lora=LoRAConfig()), "cpu")
    plain.load_state_dict(merged)
    tokens = torch.randint(0, 128, (2, 16))
    # W x + s B (A x) against (W + s B A) x: the rank's sum moves, the rest of the forward carries it.
    rank = model.cfg.lora.rank
    assert_close_fp(plain(tokens), model(tokens), torch.float32, forward_terms(model.cfg, 16) + rank)
    # The exported q weight (rows reordered to transformers' halves) is W' + s * B' @ A with B' reordered alike.
    name = "layers.0.attention.wq"
    _, hf_w = to_hf(f"{name}.weight", state[f"{name}.weight"], model.cfg)
    _, hf_b = to_hf(f"{name}.weight", state[f"{name}.lora_b"], model.cfg)
    _, hf_merged = to_hf(f"{name}.weight", merged[f"{name}.weight"], model.cfg)
    assert_close_fp(hf_merged, hf_w + 2.0 * hf_b @ state[f"{name}.lora_a"], torch.float32, rank + 1)
