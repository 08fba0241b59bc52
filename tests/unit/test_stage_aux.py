"""A mixture of experts split into pipeline stages (train/parallel/stage_aux.py), in one process: each stage's hook
backpropagates its own layers' auxiliary loss, so the stages' gradients are one process's `(loss + aux).backward()`;
the load fills each layer's global row, and a shape-inference forward before the micro-batches is not counted."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import assert_close_fp, rounding_rel, step_terms
from trainctl.config.schema import ModelConfig, MoEConfig

CFG = ModelConfig(family="qwen3_moe", dim=16, n_layers=3, n_heads=2, n_kv_heads=2, head_dim=8, ffn_dim=8,
                  vocab_size=32, max_seq_len=32, moe=MoEConfig(num_experts=4, experts_per_token=2, expert_ffn_dim=8,
                                                               aux_loss_coef=0.1))
SEQ, MICRO_BATCHES = 8, 2
TERMS = step_terms(CFG, SEQ, MICRO_BATCHES * 2 * SEQ)  # one step's chain: what two orders of its sums may differ by


def materialized(model):
    model.to_empty(device="cpu")
    torch.manual_seed(5)
    model.init_weights()
    return model


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The step's mean token loss share of one micro-batch (as loop/loss.TokenLoss normalises it)."""
    tokens = MICRO_BATCHES * targets.numel()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / tokens


def batches():
    generator = torch.Generator().manual_seed(0)
    return [(torch.randint(0, CFG.vocab_size, (2, SEQ), generator=generator),
             torch.randint(0, CFG.vocab_size, (2, SEQ), generator=generator)) for _ in range(MICRO_BATCHES)]


def one_process(cfg: ModelConfig):
    """The plain step's accumulation (loop/step.forward_backward): (gradients by name, the step's metrics)."""
    from trainctl.models.build import build_model
    from trainctl.models.common.moe import moe_blocks
    from trainctl.train.loop.expert_load import ExpertLoad

    model = materialized(build_model(cfg, "meta"))
    load = ExpertLoad(moe_blocks(model))
    for inputs, targets in batches():
        loss = token_loss(model(inputs), targets)
        aux = load.take(MICRO_BATCHES)
        (loss if aux is None else loss + aux).backward()
    return {n: p.grad for n, p in model.named_parameters()}, load.finish()


def two_stages(cfg: ModelConfig):
    """Stages [0], [1, 2] run as a schedule runs them: a shape-inference forward first, then each micro-batch's
    forward through both and its backward from the last stage's loss only."""
    from trainctl.models.common.moe import moe_blocks
    from trainctl.train.loop.expert_load import ExpertLoad
    from trainctl.train.parallel.pipeline import build_stage_model
    from trainctl.train.parallel.stage_aux import StageAux

    first = materialized(build_stage_model(cfg, range(0, 1), first=True, last=False))
    last = materialized(build_stage_model(cfg, range(1, 3), first=False, last=True))
    stage_aux = StageAux([first, last], scale_loss=lambda loss: loss)
    load = ExpertLoad(moe_blocks(first) + moe_blocks(last))
    stage_aux.begin(load, MICRO_BATCHES)
    inputs, _ = batches()[0]
    last(first(inputs).detach())  # the schedule's first step infers the stages' shapes with a forward of each
    for inputs, targets in batches():
        sent = first(inputs)
        received = sent.detach().requires_grad_()
        token_loss(last(received), targets).backward()
        sent.backward(received.grad)
    stage_aux.end()
    grads = {n: p.grad for part in (first, last) for n, p in part.named_parameters()}
    return grads, load.finish()


@pytest.mark.parity
def test_stages_get_one_process_gradients_and_metrics():
    want, want_metrics = one_process(CFG)
    got, metrics = two_stages(CFG)
    assert got.keys() == want.keys()
    for name, grad in want.items():
        assert_close_fp(got[name], grad, torch.float32, TERMS, what=name)
    assert metrics["expert_load"] == want_metrics["expert_load"] and len(metrics["expert_load"]) == CFG.n_layers
    assert sum(metrics["expert_load"][0]) == MICRO_BATCHES * 2 * SEQ * CFG.moe.experts_per_token
    # The same per-layer values, summed over layers and micro-batches in another order.
    rel = rounding_rel(torch.float32, CFG.n_layers * MICRO_BATCHES)
    assert metrics["aux_loss"] == pytest.approx(want_metrics["aux_loss"], rel=rel)


@pytest.mark.parity
def test_the_auxiliary_loss_reaches_every_stages_router():
    """Without the coefficient every router's gradient differs by more than rounding: the equality above is not the
    token loss's alone."""
    without, _ = one_process(replace(CFG, moe=replace(CFG.moe, aux_loss_coef=0.0)))
    got, _ = two_stages(CFG)
    for layer in range(CFG.n_layers):
        name = f"layers.{layer}.feed_forward.router.weight"
        bound = rounding_rel(torch.float32, TERMS) * float(without[name].abs().max())
        assert float((got[name] - without[name]).abs().max()) > bound, name
