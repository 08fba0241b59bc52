"""Incremental decoding with a key/value cache, for every family, without touching the training forward.

A separate decode path that reuses each block's own pieces: `Attention.project` (so qwen3's q/k norms and
qwen2's biases apply, and a LoRA-wrapped Linear would too), `apply_rope` on the rows of the new tokens'
positions, the block's norms and feed-forward, the model's final norm and head. The training
`Attention.forward` stays as it is (document masking and context parallelism live there).

`forward_cached(model, tokens, cache)` appends `tokens` [batch, new] at positions cache.length.. and returns
their logits; prefill (the prompt) and each decode step are the same call. Its logits equal the full forward's
(`model(all_tokens)`) at the same positions to fp32 rounding: tests/dist/test_generate.py.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional

from trainctl.models.common.rope import apply_rope


class KVCache:
    """Each layer's keys and values so far, [batch, positions, kv_heads, head_dim], after RoPE."""

    def __init__(self) -> None:
        self.keys: dict[str, torch.Tensor] = {}
        self.values: dict[str, torch.Tensor] = {}
        self.length = 0

    def extend(self, layer: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values with `k`, `v` appended (concatenation: generation is short, one device)."""
        if layer in self.keys:
            k, v = torch.cat([self.keys[layer], k], dim=1), torch.cat([self.values[layer], v], dim=1)
        self.keys[layer], self.values[layer] = k, v
        return k, v


def _causal_mask(new: int, total: int, device: torch.device) -> torch.Tensor | None:
    """Query i (position total-new+i) sees keys 0..total-new+i; None when one query sees everything cached."""
    if new == 1:
        return None
    queries = torch.arange(total - new, total, device=device)[:, None]
    return torch.arange(total, device=device)[None, :] <= queries


def attend(attention: nn.Module, x: torch.Tensor, freqs: torch.Tensor, cache: KVCache, layer: str) -> torch.Tensor:
    """One attention layer over the new tokens' normed hidden states `x`, extending the cache."""
    batch, new, _ = x.shape
    q, k, v = attention.project(x)
    q, k = apply_rope(q, freqs), apply_rope(k, freqs)
    k, v = cache.extend(layer, k, v)
    groups = attention.n_heads // attention.n_kv_heads
    # Copied kv heads run on every SDPA kernel and device (enable_gqa does not); decoding is not memory-bound here.
    k, v = (t.repeat_interleave(groups, dim=2) if groups > 1 else t for t in (k, v))
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [batch, heads, seq, head_dim]
    mask = _causal_mask(new, k.shape[2], x.device)
    out = functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return attention.wo(out.transpose(1, 2).reshape(batch, new, -1))


@torch.no_grad()
def forward_cached(model: nn.Module, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits [batch, new, vocab] of `tokens` [batch, new] placed after the cache's positions; extends it."""
    start, new = cache.length, tokens.shape[1]
    if start + new > model.freqs.shape[0]:
        raise ValueError(f"position {start + new - 1} is past model.max_seq_len={model.freqs.shape[0]}")
    freqs = model.freqs[start : start + new]
    h = model.tok_embeddings(tokens)
    for key, block in model.layers.items():
        h = h + attend(block.attention, block.attention_norm(h), freqs, cache, key)
        h = h + block.feed_forward(block.ffn_norm(h))
    cache.length = start + new
    return model.output(model.norm(h))
