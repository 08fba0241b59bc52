"""The qwen3_moe family's module: qwen3's attention (per-head q/k norms) with a mixture-of-experts MLP."""

from __future__ import annotations

from trainctl.models.common.decoder import Decoder
from trainctl.models.common.layers import QKNormAttention
from trainctl.models.common.moe import MoEBlock


class Qwen3MoEBlock(MoEBlock):
    attention_class = QKNormAttention


class Qwen3MoE(Decoder):
    block_class = Qwen3MoEBlock


MODEL = Qwen3MoE  # what models/build.py builds for model.family=qwen3_moe
