"""The qwen3 family's module: the shared decoder with an RMSNorm over each q and k head before RoPE."""

from __future__ import annotations

import torch

from trainctl.config.schema import ModelConfig
from trainctl.models.common.attention import Attention
from trainctl.models.common.decoder import Decoder
from trainctl.models.common.layers import RMSNorm, TransformerBlock


class Qwen3Attention(Attention):
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


class Qwen3Block(TransformerBlock):
    attention_class = Qwen3Attention


class Qwen3(Decoder):
    block_class = Qwen3Block


MODEL = Qwen3  # what models/build.py builds for model.family=qwen3
