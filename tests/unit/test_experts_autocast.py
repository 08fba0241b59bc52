"""The routed experts under autocast (precision=bf16 without FSDP2: DDP, ZeRO-1, one process): fp32 master weights
reach the expert kernels as the compute dtype, so the grouped matmul's test for bf16 operands can pass on CUDA; the
products are those autocast computed before, bit for bit."""

from __future__ import annotations

import pytest
import torch

from trainctl.models.common import experts as experts_mod
from trainctl.models.common.experts import ExpertAdapter, GroupedExperts, expert_loop

E, DIM, HIDDEN, RANK = 4, 16, 24, 8


def _experts(adapters: bool) -> GroupedExperts:
    torch.manual_seed(0)
    module = GroupedExperts(E, DIM, HIDDEN)
    if adapters:
        module.gate_up = ExpertAdapter(E, DIM, 2 * HIDDEN, RANK, 16.0)
        module.down = ExpertAdapter(E, HIDDEN, DIM, RANK, 16.0)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(std=0.1)
    return module


@pytest.mark.parametrize("adapters", [False, True])
def test_the_kernel_choice_sees_the_autocast_dtype(monkeypatch, adapters):
    seen = []

    def spy(x, *weights):
        seen.append({t.dtype for t in (x, *weights)})
        return False  # the loop computes (no grouped kernel on CPU)

    monkeypatch.setattr(experts_mod, "grouped_mm_applies", spy)
    module, counts = _experts(adapters), torch.tensor([3, 0, 5, 2])
    x = torch.randn(int(counts.sum()), DIM)
    module(x, counts)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        module(x, counts)
    assert seen == [{torch.float32}, {torch.bfloat16}]


@pytest.mark.parametrize("adapters", [False, True])
def test_autocast_products_are_unchanged_and_gradients_reach_the_fp32_weights(adapters):
    module, counts = _experts(adapters), torch.tensor([3, 0, 5, 2])
    x = torch.randn(int(counts.sum()), DIM)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = module(x, counts)
    # What autocast itself gives: each matmul's operands rounded to bf16, every product in bf16.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        adapters_local = [None if a is None else a.local() for a in (module.gate_up, module.down)]
        want = expert_loop(x, counts, module.w1, module.w2, module.w3, *adapters_local)
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want)
    got.float().sum().backward()
    for name, p in module.named_parameters():
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32, name
