"""The qwen2 family's module: the shared decoder with biases on q, k and v (initialized to zero)."""

from __future__ import annotations

from trainctl.config.schema import ModelConfig
from trainctl.models.common.attention import Attention
from trainctl.models.common.decoder import Decoder
from trainctl.models.common.layers import TransformerBlock


class Qwen2Attention(Attention):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, qkv_bias=True)


class Qwen2Block(TransformerBlock):
    attention_class = Qwen2Attention


class Qwen2(Decoder):
    block_class = Qwen2Block


MODEL = Qwen2  # what models/build.py builds for model.family=qwen2
