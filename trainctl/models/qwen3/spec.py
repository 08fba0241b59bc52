"""The qwen3 family (dense Qwen 3) without torch: the llama layout with an RMSNorm over each q and k head
before RoPE, and a head_dim that need not be hidden / heads (Qwen3 0.6B: 16 heads of 128 on a 1024 stream).

The per-head norm weights are reordered like one rotary head (trainctl's interleaved pairs vs transformers'
halves): the norm itself does not care about the order of a head's elements, its weight must follow it.
"""

from __future__ import annotations

from trainctl.models.common.shape import QKNormShape


class Qwen3Spec(QKNormShape):
    family = "qwen3"
    hf_model_types = ("qwen3",)
    hf_architectures = ("Qwen3ForCausalLM",)


SPEC = Qwen3Spec()
