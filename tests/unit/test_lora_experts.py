"""LoRA on a mixture of experts' routed experts (model.lora.targets expert_gate_up, expert_down), without processes:
the experts' forward with adapters against each expert's merged weight computed plainly, zero adapters equal to the
base, gradients on adapters only, the counts (formula = live model = plan), the refusals, and the exports: the PEFT
folder loaded by peft onto transformers' model, and the merged weights, both with the adapted model's logits."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import assert_close_fp, forward_terms, rounding_rel
from trainctl.config.compose import compose
from trainctl.config.errors import ConfigError
from trainctl.config.schema import LoRAConfig, ModelConfig, MoEConfig, PrecisionConfig, ShardingConfig, TrainConfig
from trainctl.config.validate import resolve
from trainctl.core.dims import ParallelDims
from trainctl.models.build import build_model
from trainctl.models.common.experts import ExpertAdapter, GroupedExperts, expert_loop
from trainctl.models.lora import init_adapters, trainable_count
from trainctl.models.lora_export import adapter_config, merge, write_adapter
from trainctl.plan import memory
from trainctl.plan.flops import lora_formula_count, param_count
from trainctl.plan.stages import rank_stages

EXPERTS = ["expert_gate_up", "expert_down"]
DIM, HIDDEN, E, K, RANK, ALPHA = 32, 24, 4, 2, 2, 4.0
QWEN = ModelConfig(family="qwen3_moe", dim=DIM, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48,
                   vocab_size=96, max_seq_len=64,
                   moe=MoEConfig(num_experts=E, experts_per_token=K, expert_ffn_dim=HIDDEN, norm_topk_prob=True))
MIXTRAL = dataclasses.replace(QWEN, family="mixtral", head_dim=0,
                              moe=dataclasses.replace(QWEN.moe, router="topk_softmax", norm_topk_prob=False))
FAMILIES = {"qwen3_moe": QWEN, "mixtral": MIXTRAL}


def with_lora(cfg: ModelConfig, targets: list[str]) -> ModelConfig:
    return dataclasses.replace(cfg, lora=LoRAConfig(rank=RANK, alpha=ALPHA, targets=targets))


def adapted_model(cfg: ModelConfig, seed: int = 0) -> torch.nn.Module:
    """The model with every adapter random (B too), and routers spread so the top-k choice is not near a tie."""
    model = build_model(cfg, "cpu")
    torch.manual_seed(seed)
    model.init_weights()
    init_adapters(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.normal_(std=0.2)
            elif name.endswith("router.weight"):
                p.normal_(std=0.5)
    return model.eval()


def adapted_terms(cfg: ModelConfig, seq_len: int) -> int:
    """The forward's chain with the MoE MLP (the experts' widths) plus each adapter's two rank-long sums and the
    k experts' weighted sum."""
    moe_view = dataclasses.replace(cfg, ffn_dim=max(cfg.ffn_dim, cfg.moe.expert_ffn_dim))
    return forward_terms(moe_view, seq_len) + cfg.n_layers * (4 * RANK + K)


# ---- the experts' forward ----

def random_experts(targets: list[str]) -> GroupedExperts:
    torch.manual_seed(1)
    experts = GroupedExperts(E, DIM, HIDDEN)
    with torch.no_grad():
        for w in (experts.w1, experts.w2, experts.w3):
            w.normal_(std=0.2)
    if "expert_gate_up" in targets:
        experts.gate_up = ExpertAdapter(E, DIM, 2 * HIDDEN, RANK, ALPHA)
    if "expert_down" in targets:
        experts.down = ExpertAdapter(E, HIDDEN, DIM, RANK, ALPHA)
    with torch.no_grad():
        for name, p in experts.named_parameters():
            if ".lora_" in name:
                p.normal_(std=0.3)
    return experts


@pytest.mark.parametrize("targets", [EXPERTS, ["expert_gate_up"], ["expert_down"]])
def test_each_expert_computes_its_weight_plus_scale_b_a(targets):
    experts = random_experts(targets)
    counts = torch.tensor([3, 0, 5, 2])  # an expert with no rows, too
    x = torch.randn(int(counts.sum()), DIM)
    got = experts(x, counts)
    scale, rows, start = ALPHA / RANK, [], 0
    for e, n in enumerate(counts.tolist()):
        w1, w3, w2 = experts.w1[e], experts.w3[e], experts.w2[e]
        if experts.gate_up is not None:  # [dim, 2 hidden]: the gate's columns, then the up's
            delta = experts.gate_up.lora_a[e] @ experts.gate_up.lora_b[e]
            w1, w3 = w1 + scale * delta[:, :HIDDEN], w3 + scale * delta[:, HIDDEN:]
        if experts.down is not None:
            w2 = w2 + scale * experts.down.lora_a[e] @ experts.down.lora_b[e]
        block = x[start:start + n]
        rows.append((F.silu(block @ w1) * (block @ w3)) @ w2)
        start += n
    want = torch.cat(rows)
    assert (want - expert_loop(x, counts, experts.w1, experts.w2, experts.w3)).abs().max() > 1e-2  # adapters count
    assert_close_fp(got, want, torch.float32, 2 * (DIM + RANK) + HIDDEN + RANK)


# ---- the model ----

@pytest.mark.parametrize("family", list(FAMILIES))
def test_zero_b_is_the_base_model_and_only_adapters_get_gradients(family):
    cfg = with_lora(FAMILIES[family], ["q", *EXPERTS])
    model = build_model(cfg, "cpu")
    torch.manual_seed(0)
    model.init_weights()
    init_adapters(model)
    base = build_model(dataclasses.replace(cfg, lora=LoRAConfig()), "cpu")
    base.load_state_dict({k: v for k, v in model.state_dict().items() if ".lora_" not in k})
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    assert torch.equal(model(tokens), base(tokens))  # B = 0: no change until it trains
    adapter = model.layers["0"].feed_forward.experts.gate_up
    assert adapter.lora_a.abs().max() > 0 and adapter.lora_b.abs().max() == 0
    model(tokens, targets=tokens).backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert {n for n in with_grad if ".experts." in n} == {
        f"layers.{i}.feed_forward.experts.{m}.lora_{x}" for i in range(2) for m in ("gate_up", "down") for x in "ab"}
    assert all(".lora_" in n for n in with_grad)
    assert not any(p.requires_grad for n, p in model.named_parameters() if ".lora_" not in n)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("targets", [EXPERTS, ["q", "v", "expert_down"], ["expert_gate_up"]])
def test_trainable_count_is_the_formula_and_the_live_models(family, targets):
    cfg = with_lora(FAMILIES[family], targets)
    model = build_model(cfg, "meta")
    head = 8
    shapes = {"q": (DIM, 4 * head), "v": (DIM, 2 * head), "expert_gate_up": (DIM, 2 * HIDDEN),
              "expert_down": (HIDDEN, DIM)}
    by_hand = 2 * sum((E if t.startswith("expert") else 1) * RANK * sum(shapes[t]) for t in targets)
    assert trainable_count(model) == lora_formula_count(cfg) == by_hand
    assert sum(p.numel() for p in model.parameters() if not p.requires_grad) == param_count(cfg)


@pytest.mark.parametrize(("strategy", "degrees"), [("ddp", {"dp_replicate": 2}), ("zero3", {"dp_shard": 4}),
                                                   ("zero3", {"dp_shard": 4, "ep": 2})])
def test_plan_counts_gradients_and_adamw_for_the_expert_adapters_only(strategy, degrees):
    m = with_lora(QWEN, EXPERTS)
    train = TrainConfig(seq_len=64, micro_batch=1, grad_accum=1, global_batch=4)
    sharding = ShardingConfig(strategy=strategy, **degrees)
    dims = ParallelDims(**degrees)
    (stage,) = rank_stages(m, sharding, 1)[:1]
    est = memory.estimate(m, PrecisionConfig(), sharding, train, dims, stage)
    shards = degrees.get("dp_shard", 1)  # FSDP2 (over efsdp under ep: E/ep experts each, so E/dp_shard rows)
    adapters = lora_formula_count(m)
    assert adapters == 2 * E * RANK * (DIM + 2 * HIDDEN + HIDDEN + DIM)
    assert est.grads == 4 * adapters // shards
    steps = 4 * 2 * 4  # one step counter per adapter tensor: 2 targets x (A, B) x 2 layers
    assert est.optimizer == 8 * adapters // shards + steps
    assert est.ddp_buckets == (4 * adapters if strategy == "ddp" else 0)


def test_the_plans_expert_share_is_the_adapters_under_lora():
    from trainctl.core.wrapping import wrapping
    from trainctl.plan.experts import expert_share

    dims = ParallelDims(dp_shard=4, ep=2)
    wrap = wrapping("zero3", dims)
    for targets, learned in ((EXPERTS, 2 * E * RANK * (2 * DIM + 3 * HIDDEN)), (["q"], 0)):
        share = expert_share(with_lora(QWEN, targets), dims, wrap, 2, 64, 4, 1, False)
        assert share.grads_bytes == 4 * learned // 4  # fp32, over dp_shard=4
    full = expert_share(QWEN, dims, wrap, 2, 64, 4, 1, False)
    assert full.grads_bytes == full.params_bytes > 0


# ---- refusals ----

def _problems(overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        resolve(compose(["data=synthetic", "train.seq_len=32", *overrides]))
    return info.value.problems


@pytest.mark.parametrize(("overrides", "starts", "names"), [
    (["recipe=tiny_cpu", "model.lora.targets=[q,expert_down]"], "model.lora.targets=['q', 'expert_down']: this "
     "model has no expert_down", "mixture-of-experts"),
    (["model=qwen3_moe_tiny", "model.lora.targets=[q,expert_gate,expert_up]"], "model.lora.targets=", "expert_gate_up"),
    (["model=qwen3_moe_tiny", "model.lora.targets=[q,up]"], "model.lora.targets=", "expert_gate_up"),
    (["model=mixtral_tiny", "model.lora.targets=[expert_down]", "model.lora.dropout=0.1"], "model.lora.dropout=0.1",
     "model.lora.dropout=0"),
    (["model=qwen3_moe_tiny", "model.lora.targets=[expert_down]", "model.lora.base_dtype=nf4"],
     "model.lora.base_dtype=nf4", "model.lora.base_dtype=fp32"),
    (["model=qwen3_moe_tiny", "model.lora.targets=[expert_down,expert_down]"], "model.lora.targets=", "twice"),
    (["model=qwen3_moe_tiny", "model.lora.rank=512", "model.lora.targets=[expert_gate_up]"], "model.lora.rank=512",
     "at most"),
])
def test_what_expert_lora_refuses_is_one_line(overrides, starts, names):
    problems = _problems([*overrides[:1], "model.lora.rank=8", *overrides[1:]])
    assert len(problems) == 1 and problems[0].startswith(starts) and names in problems[0], problems


@pytest.mark.parametrize("layout", [["sharding=ddp"], ["sharding=fsdp"], ["sharding=fsdp", "sharding.ep=2"]])
def test_expert_lora_resolves_under_data_parallel_layouts(layout):
    cfg = resolve(compose(["model=qwen3_moe_tiny", "data=synthetic", "train.seq_len=32", "cluster.procs_per_node=2",
                           "model.lora.rank=4", "model.lora.targets=[q,v,expert_gate_up,expert_down]", *layout]))
    assert cfg.model.lora.targets[-1] == "expert_down"


# ---- exports ----

def test_adapter_config_names_the_fused_expert_parameters():
    lora = LoRAConfig(rank=RANK, alpha=ALPHA, targets=["v", "q", *EXPERTS])
    config = adapter_config(lora, "")
    assert config["target_modules"] == ["q_proj", "v_proj"]
    assert config["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert "target_parameters" not in adapter_config(LoRAConfig(rank=RANK, targets=["q"]), "")


@pytest.mark.parity
@pytest.mark.parametrize("family", list(FAMILIES))
def test_merged_experts_equal_the_adapted_forward(family):
    model = adapted_model(with_lora(FAMILIES[family], ["q", *EXPERTS]))
    merged = merge(model.state_dict(), model.cfg.lora)
    assert all(".lora_" not in n for n in merged)
    plain = build_model(dataclasses.replace(model.cfg, lora=LoRAConfig()), "cpu").eval()
    plain.load_state_dict(merged)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, want = plain(tokens), model(tokens)
        unadapted = build_model(dataclasses.replace(model.cfg, lora=LoRAConfig()), "cpu").eval()
        unadapted.load_state_dict({k: v for k, v in model.state_dict().items() if ".lora_" not in k})
        assert (unadapted(tokens) - want).abs().max() > 1e-2  # the expert adapters matter
    assert_close_fp(got, want, torch.float32, adapted_terms(model.cfg, 16))


def hf_folder(model: torch.nn.Module, folder) -> None:
    """The base weights (no adapters) as a Hugging Face folder transformers loads."""
    from safetensors.torch import save_file

    from trainctl.models.hf import hf_config, to_hf_items

    cfg = model.cfg
    state = {n: t for n, t in model.state_dict().items() if ".lora_" not in n}
    save_file(dict(item for n, t in state.items() for item in to_hf_items(n, t, cfg)),
              str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(hf_config(dataclasses.replace(cfg, lora=LoRAConfig()),
                                                             torch.float32)))


@pytest.mark.parity
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("targets", [["q", "o", *EXPERTS], ["expert_down"], ["k", "expert_gate_up"]])
def test_peft_loads_the_expert_adapters_with_the_adapted_models_logits(family, targets, tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    model = adapted_model(with_lora(FAMILIES[family], targets))
    hf_folder(model, tmp_path)
    (tmp_path / "adapter").mkdir()
    write_adapter({n: t for n, t in model.state_dict().items() if ".lora_" in n}, model.cfg, tmp_path / "adapter")
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
        base_logits = base(tokens).logits
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        got = adapted(tokens).logits
        want = model(tokens)
    assert (got - base_logits).abs().max() > 1e-2  # the adapters were applied: a lost or zero B would show
    assert_close_fp(got, want, torch.float32, adapted_terms(model.cfg, 16), what="peft against trainctl")


@pytest.mark.parity
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_exporter_writes_both_from_a_checkpoint(tmp_path):
    """`trainctl export --merged` and `--adapter` (the exporter's entry) on a committed DCP checkpoint of a run with
    expert adapters: transformers on the merged folder, and peft on the base with the adapter folder, give the
    checkpointed model's logits."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from tests.unit.export_checkpoints import main, make_run

    cfg = with_lora(MIXTRAL, ["v", *EXPERTS])
    tensors = make_run(tmp_path / "run", cfg)[5]  # one AdamW step: every B moved off zero
    model = build_model(cfg, "cpu").eval()
    model.load_state_dict(tensors)
    assert main([str(tmp_path / "run"), "--merged", "--out", str(tmp_path / "merged")]) == 0
    assert main([str(tmp_path / "run"), "--adapter", "--out", str(tmp_path / "adapter")]) == 0
    (tmp_path / "base").mkdir()
    hf_folder(model, tmp_path / "base")
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model(tokens)
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
        base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
        base_logits = base(tokens).logits
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        for got, what in ((merged(tokens).logits, "merged"), (adapted(tokens).logits, "peft")):
            assert_close_fp(got, want, torch.float32, adapted_terms(cfg, 16), what=what)
    # the trained adapters moved the logits by more than rounding could: a dropped adapter would fail the above
    allowed = rounding_rel(torch.float32, adapted_terms(cfg, 16)) * want.abs().max()
    assert (want - base_logits).abs().max() > 10 * allowed
