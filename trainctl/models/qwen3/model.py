"""The qwen3 family's module: the shared decoder with an RMSNorm over each q and k head before RoPE."""

from __future__ import annotations

from trainctl.models.common.decoder import Decoder
from trainctl.models.common.layers import QKNormAttention, TransformerBlock

Qwen3Attention = QKNormAttention  # the name this family's module has always used


class Qwen3Block(TransformerBlock):
    attention_class = Qwen3Attention


class Qwen3(Decoder):
    block_class = Qwen3Block


MODEL = Qwen3  # what models/build.py builds for model.family=qwen3
