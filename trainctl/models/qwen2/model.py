"""The qwen2 family's module: the llama decoder with biases on q, k and v (initialized to zero)."""

from __future__ import annotations

from trainctl.config.schema import ModelConfig
from trainctl.models.llama.model import Attention, Llama, TransformerBlock


class Qwen2Attention(Attention):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, qkv_bias=True)


class Qwen2Block(TransformerBlock):
    attention_class = Qwen2Attention


class Qwen2(Llama):
    block_class = Qwen2Block


MODEL = Qwen2  # what models/build.py builds for model.family=qwen2
