"""The qwen3 family's module: the llama decoder with an RMSNorm over each q and k head before RoPE."""

from __future__ import annotations

import torch

from trainctl.config.schema import ModelConfig
from trainctl.models.llama.model import Attention, Llama, RMSNorm, TransformerBlock


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


class Qwen3(Llama):
    block_class = Qwen3Block


MODEL = Qwen3  # what models/build.py builds for model.family=qwen3
