"""The pieces of a decoder block every family shares: RMSNorm, the SwiGLU MLP, and the block itself."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional

from trainctl.config.schema import ModelConfig
from trainctl.models.common.attention import Attention
from trainctl.models.common.init import INIT_STD, fill, trunc_normal


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def reset_parameters(self) -> None:
        fill(self.weight, nn.init.ones_)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 for stability under bf16 autocast, then cast back.
        return functional.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).type_as(x)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def init_weights(self, out_std: float) -> None:
        for linear in (self.w1, self.w3):
            trunc_normal(linear.weight, INIT_STD)
        trunc_normal(self.w2.weight, out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(functional.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    attention_class: type[Attention] = Attention

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = self.attention_class(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def init_weights(self, out_std: float) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(out_std)
        self.feed_forward.init_weights(out_std)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        # mask by keyword: TP's PrepareModuleInput lays out the positional (x, freqs) only.
        h = x + self.attention(self.attention_norm(x), freqs, mask=mask)
        return h + self.feed_forward(self.ffn_norm(h))


class QKNormAttention(Attention):
    """Qwen3's attention (qwen3, qwen3_moe): an RMSNorm over each q and k head before RoPE."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps)

    def init_weights(self, out_std: float) -> None:
        super().init_weights(out_std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project(x)
        return self.q_norm(q), self.k_norm(k), v
