"""Grouped-query attention every family shares, SDPA's kernel order, and the packed-documents mask."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn import functional
from torch.nn.attention import SDPBackend, sdpa_kernel

from trainctl.config.schema import ModelConfig
from trainctl.models.common.init import INIT_STD, fill, trunc_normal
from trainctl.models.common.rope import apply_rope
from trainctl.models.common.shape import head_dim

# SDPA's kernels in the order the worker prefers them on CUDA: cuDNN and flash (bf16/fp16 only), then the
# memory-efficient kernel (fp32 too), then the math fallback, which materializes batch x heads x seq x seq.
ATTENTION_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                      SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention_backends(first: str = "cudnn") -> contextlib.AbstractContextManager:
    """Entered once around the worker's training: SDPA tries ATTENTION_BACKENDS in that order; `first`="flash"
    (train.attention) leaves cuDNN out, the one-key fallback when a cuDNN kernel misbehaves.

    Once, not per call: the setting is global, and a per-block context would be traced into every
    compiled block.
    """
    order = [b for b in ATTENTION_BACKENDS if first == "cudnn" or b != SDPBackend.CUDNN_ATTENTION]
    return sdpa_kernel(order, set_priority=True)


def expands_kv(q: torch.Tensor) -> bool:
    """Whether grouped-query attention copies the kv heads up instead of passing enable_gqa.

    enable_gqa runs only in the flash and math kernels, and flash (like cuDNN) needs bf16/fp16:
    fp32 on CUDA with enable_gqa would fall back to math. Copied kv heads let the memory-efficient
    kernel run it; bf16/fp16 keep enable_gqa (no copies), and so does the CPU.
    """
    return q.is_cuda and q.dtype == torch.float32


def document_positions_mask(positions: torch.Tensor) -> torch.Tensor:
    """Block-causal attention mask [batch, 1, seq, seq] (True: may attend) of packed documents.

    positions [batch, seq]: each token's position in its document, 0 where a document starts; a token sees
    only the tokens of its own document up to itself, as if each document were a row of its own.
    """
    documents = torch.cumsum(positions == 0, dim=1)  # a document's number within its row
    same = documents[:, :, None] == documents[:, None, :]
    seq_len = positions.shape[1]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=positions.device).tril()
    return (same & causal)[:, None]


class Attention(nn.Module):
    """Grouped-query attention: n_kv_heads key/value heads shared by n_heads query heads."""

    def __init__(self, cfg: ModelConfig, qkv_bias: bool = False):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = head_dim(cfg)
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        self.repeat_kv = False  # context parallelism: copy kv heads up front (train/parallel/context_parallel.py)

    def init_weights(self, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            trunc_normal(linear.weight, INIT_STD)
            if linear.bias is not None:
                fill(linear.bias, nn.init.zeros_)
        trunc_normal(self.wo.weight, out_std)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [batch, seq, heads, head_dim] before RoPE (a tp rank sees its own heads only)."""
        batch, seq_len, _ = x.shape
        return tuple(linear(x).view(batch, seq_len, -1, self.head_dim) for linear in (self.wq, self.wk, self.wv))

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """mask: a boolean [batch, 1, seq, seq] (document_positions_mask) instead of plain causal attention."""
        batch, seq_len, _ = x.shape
        q, k, v = self.project(x)
        q, k = apply_rope(q, freqs), apply_rope(k, freqs)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [batch, heads, seq, head_dim]
        grouped = self.n_kv_heads != self.n_heads
        # An explicit mask rules out flash and cuDNN on CUDA; copied kv heads let the memory-efficient kernel run.
        if grouped and (self.repeat_kv or expands_kv(q) or (mask is not None and q.is_cuda)):
            k, v = (t.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1) for t in (k, v))
            grouped = False
        # The kv heads are shared by groups of query heads (enable_gqa avoids materializing copies).
        if mask is None:
            out = functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)
        else:
            out = functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=grouped)
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))
