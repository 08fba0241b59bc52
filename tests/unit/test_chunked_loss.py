"""The chunked output projection + cross-entropy (models/loss_head.py) against the dense loss.

Same summed loss and same gradients for every parameter, in fp32 to rounding, whatever the chunk size
(one token, one that does not divide the token count, all tokens at once), tied or untied
embeddings, ignored targets; bf16 autocast to bf16 rounding; no gradients computed under no_grad.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.helpers import assert_close_fp, rounding_rel, step_terms
from trainctl.config.schema import ModelConfig
from trainctl.models import loss_head
from trainctl.models.build import build_model
from trainctl.models.loss_head import chunk_tokens, dense_loss_sum, linear_cross_entropy

real_chunk = loss_head._chunk
TINY = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=97, max_seq_len=16)


def _model(tie: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(replace(TINY, tie_embeddings=tie), "cpu")
    model.init_weights()
    return model


def _grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parity
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, 48, 10_000])
def test_chunked_loss_and_gradients_equal_the_dense_ones_in_fp32(monkeypatch, tie, chunk):
    model = _model(tie)
    tokens = torch.randint(0, TINY.vocab_size, (3, 16))
    targets = torch.randint(0, TINY.vocab_size, (3, 16))
    targets[1, 4] = loss_head.IGNORE_INDEX
    dense = dense_loss_sum(model(tokens), targets)
    want = _grads(model, dense)
    monkeypatch.setattr(loss_head, "chunk_tokens", lambda vocab, dim: chunk)  # odd sizes: the loop's edges
    seen = []
    monkeypatch.setattr(loss_head, "_chunk", lambda h, *rest: seen.append(h.shape[0]) or real_chunk(h, *rest))
    chunked = model(tokens, targets=targets)  # the model's own path: its head chunks
    assert seen[0] == min(chunk, 48) and sum(seen) == 48
    # Chunks sum the loss and the head's gradients in another order; the backward carries that through the model.
    terms = step_terms(TINY, 16, 48)
    assert_close_fp(chunked, dense, torch.float32, terms, what="loss")
    got = _grads(model, chunked)
    assert got.keys() == want.keys()
    for name in want:
        assert_close_fp(got[name], want[name], torch.float32, terms, what=name)


@pytest.mark.parity
def test_a_wrong_gradient_would_be_caught():
    # Rounding's bound is sharp enough: halving one chunk's gradient is far outside it.
    torch.manual_seed(0)
    hidden = torch.randn(10, 8, requires_grad=True)
    weight = torch.randn(20, 8, requires_grad=True)
    targets = torch.randint(0, 20, (10,))
    dense = dense_loss_sum(hidden @ weight.t(), targets)
    (want,) = torch.autograd.grad(dense, hidden)
    (got,) = torch.autograd.grad(linear_cross_entropy(hidden, weight, targets, 3), hidden)
    terms = 8 + 2 * 20 + 10  # the logits (dim), the softmax and the gradient's product (vocab each), the tokens
    assert_close_fp(got, want, torch.float32, terms)
    got[:3] *= 0.5
    with pytest.raises(AssertionError):
        assert_close_fp(got, want, torch.float32, terms)


@pytest.mark.parity
def test_bf16_autocast_projects_in_bf16_like_the_linear():
    torch.manual_seed(0)
    hidden = torch.randn(2, 24, 16, requires_grad=True)
    weight = (torch.randn(50, 16) * 0.1).requires_grad_()
    targets = torch.randint(0, 50, (2, 24))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chunked = linear_cross_entropy(hidden, weight, targets, 5)
        dense = dense_loss_sum(torch.nn.functional.linear(hidden, weight), targets)
    assert chunked.dtype == torch.float32
    # The same bf16 logits, the same fp32 softmax: equal up to fp32 summation order (vocab, then tokens).
    assert_close_fp(chunked, dense, torch.float32, 50 + 48)
    got = torch.autograd.grad(chunked, (hidden, weight))
    want = torch.autograd.grad(dense, (hidden, weight))
    # Each product accumulates in fp32 and is rounded to bf16 once, on both sides.
    rel = rounding_rel(torch.bfloat16, 1) + rounding_rel(torch.float32, 50 + 48)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=rel, atol=rel * w.abs().max().item())


@pytest.mark.parity
def test_no_gradients_are_computed_under_no_grad(monkeypatch):
    calls = []
    real = loss_head._chunk
    monkeypatch.setattr(loss_head, "_chunk", lambda *a: calls.append(a[-2:]) or real(*a))
    hidden, weight = torch.randn(6, 4), torch.randn(9, 4)
    targets = torch.randint(0, 9, (6,))
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, targets, 4)
    assert_close_fp(loss, dense_loss_sum(hidden @ weight.t(), targets), torch.float32, 4 + 9 + 6)  # dim, vocab, tokens
    assert calls == [(None, None), (None, None)]  # no gradient buffers


@pytest.mark.parity
def test_tensor_parallel_heads_keep_the_dense_loss():
    model = _model(tie=False)
    tokens = torch.randint(0, TINY.vocab_size, (2, 8))
    targets = torch.randint(0, TINY.vocab_size, (2, 8))
    model.output.chunked = False  # what apply_tp sets
    calls = []
    model.output.register_forward_hook(lambda mod, args, out: calls.append(out.shape))
    loss = model(tokens, targets=targets)
    assert calls == [torch.Size([2, 8, TINY.vocab_size])]  # whole logits, then the dense loss
    assert_close_fp(loss, dense_loss_sum(model(tokens), targets), torch.float32, step_terms(TINY, 8, 16))


def _peak_rise(fn) -> int:
    """The largest rise of CPU allocator memory while `fn` runs (torch's memory profiler, as PeakMeter uses)."""
    from torch.profiler import ProfilerActivity, profile

    from trainctl.train.observe.peak_memory import profiled_rise

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return profiled_rise(prof)


# dist, not unit: a whole-model forward and backward at a 32k vocabulary, twice each way, under the profiler
# (~2-5 s); the unit tier keeps the chunked loss's exactness checks above.
@pytest.mark.dist
def test_measured_cpu_peak_of_a_large_vocabulary_micro_batch_drops_by_the_fp32_logits():
    config = replace(TINY, vocab_size=32_000, max_seq_len=256)
    torch.manual_seed(0)
    model = build_model(config, "cpu")
    model.init_weights()
    tokens = torch.randint(0, config.vocab_size, (2, 256))
    targets = torch.randint(0, config.vocab_size, (2, 256))
    fp32_logits = tokens.numel() * config.vocab_size * 4  # 65.5 MB
    assert chunk_tokens(config.vocab_size, config.dim) == 128  # 4 chunks

    def step(chunked: bool):
        model.zero_grad(set_to_none=True)
        loss = model(tokens, targets=targets) if chunked else dense_loss_sum(model(tokens), targets)
        loss.backward()

    step(True), step(False)  # warm up both paths
    dense, chunked = _peak_rise(lambda: step(False)), _peak_rise(lambda: step(True))
    print(f"peak rise: dense {dense / 2**20:.1f} MiB, chunked {chunked / 2**20:.1f} MiB, "
          f"fp32 logits {fp32_logits / 2**20:.1f} MiB")
    assert dense - chunked >= fp32_logits
