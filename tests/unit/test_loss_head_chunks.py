"""The loss head's chunk size from the plan's headroom, and its fp32 weight gradient (issue 31, item 1)."""

from __future__ import annotations

import pytest
import torch

from trainctl.core import loss_head as rule
from trainctl.models import loss_head

pytestmark = pytest.mark.unit

V, D = 128256, 2048  # Llama 3.2 1B's head
PER_TOKEN = rule.chunk_temp_bytes(V, 2)


def test_a_chunk_token_costs_its_fp32_row_and_two_compute_dtype_rows():
    assert rule.chunk_temp_bytes(V, 2) == V * (4 + 2 + 2)
    assert rule.chunk_temp_bytes(V, 4) == V * 4  # fp32: one buffer, in place


@pytest.mark.parametrize(("tokens", "room", "want"), [
    (16384, 0, 4096),  # no headroom: a quarter of the dense loss's two fp32 gradients (bf16: 4 chunks)
    (16384, 100 * PER_TOKEN, 4096),  # less room than that: the same
    (16384, 6000 * PER_TOKEN, 5888),  # more: the largest multiple of 128 that fits
    (16384, 16384 * PER_TOKEN, 16384),  # room for every token: one chunk
    (300, 10**12, 300),  # one chunk of a short micro-batch, whatever its alignment
    (300, 0, 300),  # the floor (512 tokens) is larger than the micro-batch: one chunk
    (1000, 0, 512),  # a quarter would be 250 tokens: never below the floor
])
def test_chunks_grow_with_the_plans_headroom_down_to_one(tokens, room, want):
    got = rule.planned_chunk_tokens(V, D, tokens, room, 2)
    assert got == want
    assert got == tokens or got % rule.CHUNK_ALIGN == 0
    budget = max(room, 2 * 4 * V * tokens // rule.DENSE_SHARE)
    if rule.chunk_tokens(V, D) < got < tokens:
        assert got * PER_TOKEN <= budget < (got + rule.CHUNK_ALIGN) * PER_TOKEN  # the largest that fits


def test_fp32_chunks_are_twice_as_long_as_bf16_ones():
    assert rule.planned_chunk_tokens(V, D, 16384, 0, 4) == 8192  # one fp32 row per token, not fp32 + 2 bf16


def test_the_fp32_weight_gradient_is_accumulated_in_fp32_against_a_float64_reference():
    """Under bf16 autocast the fp32 weight's gradient is sum over tokens of g_t h_t^T with bf16 operands. bf16 x bf16
    products are exact in fp32, so fp32 accumulation over T tokens errs by at most T * 2^-24 * sum |g| |h| per
    element; a round trip through bf16 would add up to 2^-9 of each element, far outside that bound."""
    torch.manual_seed(0)
    tokens, dim, vocab = 256, 32, 512
    hidden = torch.randn(tokens, dim).bfloat16().float().requires_grad_()
    weight = torch.randn(vocab, dim).bfloat16().float().requires_grad_()
    targets = torch.randint(0, vocab, (tokens,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_head.linear_cross_entropy(hidden, weight, targets, tokens)  # one chunk: the reference's logits
    loss.backward()
    assert weight.grad.dtype == torch.float32
    # The same bf16 logits and bf16 softmax gradient the head computed, then the product in float64.
    h16, w16 = hidden.detach().bfloat16(), weight.detach().bfloat16()
    _, g16 = loss_head._eager_body(h16 @ w16.t(), targets, True)
    want = g16.double().t() @ h16.double()
    bound = tokens * 2.0**-24 * (g16.double().abs().t() @ h16.double().abs())
    error = (weight.grad.double() - want).abs()
    assert (error <= bound).all(), f"worst error/bound {(error / bound).max():.2f}"
    # The test can tell: the same gradient rounded to bf16 and back breaks the bound.
    rounded = (weight.grad.bfloat16().double() - want).abs()
    assert (rounded > bound).any()
