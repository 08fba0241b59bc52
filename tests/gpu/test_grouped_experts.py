"""The routed experts' one-kernel path (torch._grouped_mm) on CUDA: taken for bf16 with aligned widths, and equal to
the exact loop, with and without LoRA's expert adapters. Skipped without a CUDA device."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_close_fp
from trainctl.models.common.experts import ExpertAdapter, GroupedExperts, expert_loop, grouped_mm_applies

CUDA = torch.cuda.is_available()
E, DIM, HIDDEN, RANK = 4, 64, 128, 8  # every width 16-byte aligned in bf16


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("adapters", [False, True])
def test_grouped_mm_is_taken_and_equals_the_loop(adapters):
    torch.manual_seed(0)
    experts = GroupedExperts(E, DIM, HIDDEN)
    if adapters:
        experts.gate_up = ExpertAdapter(E, DIM, 2 * HIDDEN, RANK, 16.0)
        experts.down = ExpertAdapter(E, HIDDEN, DIM, RANK, 16.0)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(std=0.05)
    experts = experts.to("cuda", torch.bfloat16)
    counts = torch.tensor([40, 0, 24, 64], device="cuda")
    x = torch.randn(int(counts.sum()), DIM, device="cuda", dtype=torch.bfloat16)
    weights = [experts.w1] + ([experts.gate_up.lora_a, experts.gate_up.lora_b] if adapters else [])
    assert grouped_mm_applies(x, *weights)
    got = experts(x, counts)
    gate_up = experts.gate_up.local() if adapters else None
    down = experts.down.local() if adapters else None
    want = expert_loop(x, counts, experts.w1, experts.w2, experts.w3, gate_up, down)
    # both round each product to bf16: the longest chain is the two widths' sums plus the adapters' rank sums
    assert_close_fp(got.float(), want.float(), torch.bfloat16, DIM + HIDDEN + 2 * RANK)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_fp32_weights_under_autocast_take_the_grouped_kernel(monkeypatch):
    """precision=bf16 under DDP or one process: fp32 master weights, autocast; the experts still run as one kernel."""
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(a[1].dtype) or real(*a, **k))
    torch.manual_seed(0)
    experts = GroupedExperts(E, DIM, HIDDEN).to("cuda")
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(std=0.05)
    counts = torch.tensor([40, 0, 24, 64], device="cuda")
    x = torch.randn(int(counts.sum()), DIM, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = experts(x, counts)
    assert calls == [torch.bfloat16] * 3
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = expert_loop(x, counts, experts.w1, experts.w2, experts.w3)
    assert_close_fp(got.float(), want.float(), torch.bfloat16, DIM + HIDDEN)
    got.float().sum().backward()
    assert experts.w1.grad is not None and experts.w1.grad.dtype == torch.float32
