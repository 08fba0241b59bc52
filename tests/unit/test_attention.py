"""Attention on CUDA, checked on CPU: the backend order the worker sets, and the fp32 grouped-query path."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend

from tests.helpers import assert_close_fp, forward_terms
from trainctl.config.schema import ModelConfig
from trainctl.models.build import build_model
from trainctl.models.common import attention as common_attention

pytestmark = pytest.mark.unit

GQA = ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, max_seq_len=16)


def test_the_worker_prefers_cudnn_then_flash_then_efficient_then_math_and_restores_the_order():
    before = torch._C._get_sdp_priority_order()
    with common_attention.attention_backends():
        order = torch._C._get_sdp_priority_order()
    want = [int(b) for b in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                             SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)]
    assert order[:4] == want
    assert torch._C._get_sdp_priority_order() == before


def test_only_fp32_on_cuda_copies_the_kv_heads():
    assert not common_attention.expands_kv(torch.zeros(1))  # CPU fp32: enable_gqa (the math kernel handles it)
    assert not common_attention.expands_kv(torch.zeros(1, dtype=torch.bfloat16))


@pytest.mark.parity
def test_copied_kv_heads_give_the_same_attention_as_enable_gqa(monkeypatch):
    torch.manual_seed(0)
    model = build_model(GQA, "cpu")
    model.init_weights()
    attention = model.layers["0"].attention
    x = torch.randn(2, 16, GQA.dim)
    calls = []
    real_sdpa = common_attention.functional.scaled_dot_product_attention

    def sdpa(q, k, v, **kwargs):
        calls.append((k.shape[1], kwargs.get("enable_gqa")))
        return real_sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(common_attention.functional, "scaled_dot_product_attention", sdpa)
    grouped = attention(x, model.freqs)
    monkeypatch.setattr(common_attention, "expands_kv", lambda q: True)  # what fp32 on CUDA takes
    expanded = attention(x, model.freqs)
    assert calls == [(GQA.n_kv_heads, True), (GQA.n_heads, False)]
    # Another SDPA path sums the scores and values in another order: one block's chain bounds it.
    assert_close_fp(expanded, grouped, torch.float32, forward_terms(GQA, x.shape[1]))
