"""The qwen2 family's module: the llama decoder with biases on q, k and v (initialized to zero)."""

from __future__ import annotations

import torch

from trainctl.config.schema import ModelConfig
from trainctl.models.llama.model import Attention, Llama, TransformerBlock


class Qwen2Attention(Attention):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, qkv_bias=True)


class Qwen2Block(TransformerBlock):
    attention_class = Qwen2Attention


class Qwen2(Llama):
    block_class = Qwen2Block


def build_model(cfg: ModelConfig, device: str | torch.device = "meta") -> Qwen2:
    """The model on `device` (meta by default: shapes only, no memory, no init)."""
    with torch.device(device):
        return Qwen2(cfg)
