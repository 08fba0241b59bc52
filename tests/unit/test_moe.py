"""The MoE block (models/common/moe.py) against a token-by-token reference, its routers, capacity, auxiliary loss
and bias balancing; the step's auxiliary loss under accumulation (train/loop/expert_load.py); and the MoE refusals."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from trainctl.config.compose import compose
from trainctl.config.errors import ConfigError
from trainctl.config.schema import ModelConfig, MoEConfig
from trainctl.config.validate import resolve

CFG = ModelConfig(family="mixtral", dim=16, n_layers=2, n_heads=2, n_kv_heads=2, ffn_dim=8, vocab_size=32,
                  max_seq_len=32, moe=MoEConfig(num_experts=4, experts_per_token=2, expert_ffn_dim=8,
                                                router="topk_softmax", aux_loss_coef=0.01))


def block(moe: MoEConfig, seed: int = 0):
    from trainctl.models.common.moe import MoE

    torch.manual_seed(seed)
    module = MoE(replace(CFG, moe=moe))
    module.init_weights(0.02)
    with torch.no_grad():
        module.router.weight.normal_(0, 1.0)  # decisive routing
    return module


def reference(module, x: torch.Tensor) -> torch.Tensor:
    """Each token through its k experts one at a time, weighted, plus the shared expert (no capacity)."""
    logits = x @ module.router.weight.T
    probs = torch.softmax(logits, -1)
    k, e = module.moe.experts_per_token, module.experts
    top, chosen = torch.topk(probs, k, dim=-1)
    weights = top / top.sum(-1, keepdim=True) if module.moe.norm_topk_prob or module.moe.router == "topk_softmax" \
        else top
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(k):
            i = chosen[t, j]
            out[t] += weights[t, j] * ((F.silu(x[t] @ e.w1[i]) * (x[t] @ e.w3[i])) @ e.w2[i])
    return out + (module.shared(x) if module.shared is not None else 0)


@pytest.mark.parametrize("moe", [CFG.moe, replace(CFG.moe, router="softmax_topk", norm_topk_prob=False),
                                 replace(CFG.moe, router="softmax_topk", shared_expert_ffn_dim=8)])
def test_the_block_equals_token_by_token_experts(moe):
    module = block(moe)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        got = module(x).reshape(10, 16)
        assert torch.allclose(got, reference(module, x.reshape(10, 16)), atol=1e-6)
    assert int(module.load["counts"].sum()) == 10 * moe.experts_per_token and int(module.load["dropped"]) == 0


def test_the_auxiliary_loss_is_switchs_per_layer_share():
    module = block(CFG.moe)
    x = torch.randn(12, 16)
    module(x)
    probs = torch.softmax(x @ module.router.weight.T, -1)
    f = module.load["counts"].float() / 12
    expected = 0.01 * 4 * (f * probs.mean(0)).sum() / CFG.n_layers
    assert torch.allclose(module.aux_loss, expected) and module.aux_loss.requires_grad


def test_a_capacity_drops_the_latest_tokens_of_an_overloaded_expert():
    from trainctl.models.common.moe import dispatch

    chosen = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])  # expert 0 is wanted 4 times
    order, kept, dropped = dispatch(chosen, 4, capacity=2)
    assert kept.tolist() == [2, 2, 1, 1] and int(dropped) == 2
    assert (order // 2).tolist() == [0, 1, 0, 2, 1, 3]  # expert 0 keeps tokens 0 and 1 (token order)
    module = block(replace(CFG.moe, capacity_factor=0.5))  # ceil(0.5 * 8 * 2 / 4) = 2 per expert
    with torch.no_grad():
        module(torch.randn(8, 16))
    assert int(module.load["counts"].sum()) + int(module.load["dropped"]) == 16
    assert int(module.load["counts"].max()) <= 2


def test_the_balancing_bias_moves_toward_even_load_and_never_weights():
    from trainctl.models.common.moe import route

    module = block(replace(CFG.moe, bias_update_rate=0.1))
    module.update_bias(torch.tensor([10, 2, 2, 2]))
    assert module.expert_bias.tolist() == pytest.approx([-0.1, 0.1, 0.1, 0.1])
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    _, weights, chosen = route(logits, replace(CFG.moe, router="softmax_topk", norm_topk_prob=False),
                               torch.tensor([-10.0, 0.0, 0.0, 0.0]))
    assert set(chosen[0].tolist()) == {1, 2}
    assert torch.allclose(weights, torch.softmax(logits, -1)[:, [1, 2]])


def test_the_steps_auxiliary_loss_is_the_mean_over_micro_batches():
    """Two micro-batches of the same tokens add what one does: the aux loss is weighted 1/micro-batches."""
    from trainctl.models.build import build_model
    from trainctl.models.common.moe import moe_blocks
    from trainctl.train.loop.expert_load import ExpertLoad

    torch.manual_seed(0)
    model = build_model(CFG, "cpu")
    model.init_weights()
    tokens = torch.randint(0, 32, (2, 8))
    one = ExpertLoad(moe_blocks(model))
    model(tokens)
    single = one.take(1)
    two = ExpertLoad(moe_blocks(model))
    model(tokens)
    first = two.take(2)
    model(tokens)
    total = first + two.take(2)
    assert torch.allclose(single, total)
    metrics = two.finish()
    assert metrics["aux_loss"] == pytest.approx(single.item())
    assert [sum(layer) for layer in metrics["expert_load"]] == [2 * 16 * 2] * 2
    assert ExpertLoad(moe_blocks(torch.nn.Linear(2, 2))).finish() == {}  # a dense model: nothing, no collective


@pytest.mark.parametrize(("overrides", "starts"), [
    (["model.moe.num_experts=8"], "model.moe.num_experts=8: model.family=llama is dense"),
    (["model=mixtral_tiny", "model.moe.experts_per_token=5"], "model.moe.experts_per_token=5: more than"),
    (["model=mixtral_tiny", "model.moe.router=softmax_topk"], "model.moe.router='softmax_topk': mixtral routes"),
    (["model=qwen3_moe_tiny", "model.moe.shared_expert_ffn_dim=8"], "model.moe.shared_expert_ffn_dim=8"),
    (["model=qwen3_moe_tiny", "model.lora.rank=2", "model.lora.targets=[q,down]"], "model.lora.targets="),
    (["model=qwen3_moe_tiny", "cluster.procs_per_node=2", "sharding=none", "sharding.tp=2",
      "model.moe.capacity_factor=1.25"], "model.moe.capacity_factor=1.25: with sharding.tp=2"),
    (["model=qwen3_moe_tiny", "train.objective=simpo"], "model.moe: train.objective=simpo does not balance"),
])
def test_what_the_moe_families_do_not_run_is_one_line(overrides, starts):
    with pytest.raises(ConfigError) as err:
        resolve(compose([*overrides, "data=synthetic", "train.seq_len=32"]))
    assert [p for p in err.value.problems if p.startswith(starts)], err.value.problems


@pytest.mark.parametrize("ep", [1, 2])  # ep x tp: the experts replicated over tp (train/parallel/expert.py)
@pytest.mark.parametrize("model", ["qwen3_moe_tiny", "mixtral_tiny"])
def test_tensor_parallelism_resolves_for_the_moe_families(model, ep):
    cfg = resolve(compose([f"model={model}", "data=synthetic", "train.seq_len=32", "cluster.procs_per_node=4",
                           "sharding=fsdp", "sharding.dp_shard=2", "sharding.tp=2", f"sharding.ep={ep}"]))
    assert cfg.sharding.tp == 2 and cfg.sharding.ep == ep and cfg.model.moe.num_experts > 0


def test_lora_on_attention_and_fsdp_resolve_for_an_moe_family():
    cfg = resolve(compose(["model=qwen3_moe_tiny", "model.lora.rank=2", "model.lora.targets=[q,v]",
                           "data=synthetic", "train.seq_len=32", "cluster.procs_per_node=2", "sharding=fsdp"]))
    assert cfg.model.family == "qwen3_moe" and cfg.model.moe.num_experts == 4


@pytest.mark.parametrize("model", ["qwen3_moe_tiny", "mixtral_tiny"])
@pytest.mark.parametrize("layout", [["cluster.procs_per_node=2", "sharding=none"],
                                    ["cluster.procs_per_node=4", "sharding=fsdp", "sharding.dp_shard=2"],
                                    ["cluster.procs_per_node=4", "sharding=none", "sharding.tp=2"]])
def test_pipeline_stages_resolve_for_the_moe_families(model, layout):
    """Each stage backpropagates its own layers' auxiliary loss (train/parallel/stage_aux.py): pp is not refused."""
    cfg = resolve(compose([f"model={model}", "data=synthetic", "train.seq_len=32", *layout, "sharding.pp=2",
                           "train.global_batch=8", "train.micro_batch=2", "train.grad_accum=-1"]))
    assert cfg.sharding.pp == 2 and cfg.model.moe.num_experts > 0
