"""What keeps the chunked loss head (models/loss_head.py) as fast as a dense one (issue 22, "The loss head").

Chunks are whole multiples of 128 tokens sized by a memory budget; the weight gradient is accumulated in
place into one fp32 buffer (no [vocab, dim] partial or copy per chunk); backward scales in place and a
second backward is refused, not doubled; the body torch.compile fuses is the eager body's equal; it is
compiled only on CUDA with a C compiler and Python's headers.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers import assert_close_fp
from trainctl.core import loss_head as rule
from trainctl.models import loss_head
from trainctl.models.loss_head import dense_loss_sum, linear_cross_entropy

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("vocab", "dim", "want"), [
    (32768, 2048, 512),  # the bench's first size: fp32 logits of a chunk = a quarter of the fp32 weight gradient
    (128256, 4096, 1024),  # Llama 3 8B's head (was 523 tokens)
    (128256, 2048, 512),  # Llama 3.2 1B's
    (97, 32, 128),  # never fewer than 128 tokens
    (262144, 16384, 1024),  # at most CHUNK_BYTES of fp32 logits
])
def test_chunks_are_whole_multiples_of_128_tokens_within_the_budget(vocab, dim, want):
    got = rule.chunk_tokens(vocab, dim)
    assert got == want and got % rule.CHUNK_ALIGN == 0
    assert got == rule.CHUNK_ALIGN or 4 * got * vocab <= rule.chunk_budget(vocab, dim) <= rule.CHUNK_BYTES
    assert 4 * (got + rule.CHUNK_ALIGN) * vocab > rule.chunk_budget(vocab, dim)  # the largest that fits


class BigOutputs(TorchDispatchMode):
    """Records every op that returns new memory of at least `numel` elements (views, in-place and out= ops
    return storage that exists already and are not recorded)."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.ops = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {a.untyped_storage().data_ptr() for a in (*args, *(kwargs or {}).values())
                if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() >= self.numel and t.untyped_storage().data_ptr() not in seen:
                self.ops.append(func.overloadpacket.__name__)
        return out


@pytest.mark.parametrize("autocast", [False, True])
def test_the_weight_gradient_is_accumulated_in_place_in_one_buffer(autocast):
    vocab, dim, tokens = 512, 64, 40
    hidden = torch.randn(tokens, dim, requires_grad=True)
    weight = torch.randn(vocab, dim, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    mode = BigOutputs(vocab * dim)
    with mode:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = linear_cross_entropy(hidden, weight, targets, 8)  # 5 chunks, each [8, vocab] < [vocab, dim]
        loss.backward()
    # The one fp32 accumulator; under autocast also the weight's cast to bf16 for the projection, and no cast of
    # the gradient: the fp32 weight gets the accumulator itself (no fp32 -> bf16 -> fp32 round trip).
    want = ["zeros"] + (["_to_copy"] if autocast else [])
    assert sorted(mode.ops) == sorted(want), mode.ops
    assert weight.grad.dtype == torch.float32


def _case(vocab=50, tokens=30):
    torch.manual_seed(0)
    logits = torch.randn(tokens, vocab) * 3
    targets = torch.randint(0, vocab, (tokens,))
    targets[3] = targets[17] = loss_head.IGNORE_INDEX
    return logits, targets


@pytest.mark.parity
def test_the_compiled_body_computes_what_the_eager_body_does():
    logits, targets = _case()
    leaf = logits.clone().requires_grad_()
    dense = dense_loss_sum(leaf, targets)
    (want,) = torch.autograd.grad(dense, leaf)
    for body in (loss_head._pure_body, loss_head._eager_body):
        loss, grad = body(logits.clone(), targets, True)
        assert_close_fp(loss, dense.detach(), torch.float32, 50 + 30, what="loss")  # the vocab, then the tokens
        assert_close_fp(grad, want, torch.float32, 50, what="gradient")  # a softmax over the vocab
        assert grad[3].abs().sum() == 0 and grad[17].abs().sum() == 0  # ignored tokens add nothing


def test_the_body_is_compiled_only_on_cuda_with_a_compiler_and_headers(monkeypatch):
    def compiled(device) -> bool:
        loss_head._can_compile.cache_clear()  # looked up once per process; each case here is a new "process"
        return loss_head.compiled(device)

    monkeypatch.setattr(loss_head.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(loss_head.Path, "exists", lambda self: True)
    assert compiled("cuda") and compiled(torch.device("cuda", 1))
    assert not compiled("cpu")  # eager on CPU: as fast there, no compile time
    monkeypatch.setattr(loss_head.shutil, "which", lambda name: None)  # no C compiler: Triton could not build
    assert not compiled("cuda")
    monkeypatch.setattr(loss_head.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(loss_head.Path, "exists", lambda self: False)  # no Python.h
    assert not compiled("cuda")


def test_a_second_backward_through_the_same_graph_is_refused_not_doubled():
    hidden = torch.randn(6, 4, requires_grad=True)
    weight = torch.randn(9, 4, requires_grad=True)
    loss = linear_cross_entropy(hidden, weight, torch.randint(0, 9, (6,)), 4) * 0.5
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parity
def test_a_frozen_weight_gets_no_gradient_and_the_input_the_dense_one():
    hidden = torch.randn(10, 8, requires_grad=True)
    weight = torch.randn(20, 8)
    targets = torch.randint(0, 20, (10,))
    (want,) = torch.autograd.grad(dense_loss_sum(hidden @ weight.t(), targets) / 3, hidden)
    (got,) = torch.autograd.grad(linear_cross_entropy(hidden, weight, targets, 3) / 3, hidden)
    assert_close_fp(got, want, torch.float32, 8 + 2 * 20 + 10)  # logits (dim), softmax and product (vocab), tokens


def test_the_compiler_lookup_is_not_repeated_per_call(monkeypatch):
    """The forward makes no file-system lookups: whether the body compiles is decided once per process."""
    loss_head._can_compile.cache_clear()
    lookups = []
    monkeypatch.setattr(loss_head.shutil, "which", lambda name: lookups.append(name) or f"/usr/bin/{name}")
    for _ in range(3):
        loss_head.compiled("cuda")
    assert len(lookups) == 1
    loss_head._can_compile.cache_clear()
