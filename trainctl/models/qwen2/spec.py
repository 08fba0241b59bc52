"""The qwen2 family (Qwen 2 and 2.5) without torch: the llama layout with biases on the q, k and v projections.

The q and k biases are rotary rows like their weights (reordered between trainctl's interleaved pairs and
transformers' halves); the v bias is not. Per-layer sliding windows (use_sliding_window) are refused.
"""

from __future__ import annotations

from pathlib import Path

from trainctl.models.common.shape import DecoderSpec


class Qwen2Spec(DecoderSpec):
    family = "qwen2"
    hf_model_types = ("qwen2",)
    hf_architectures = ("Qwen2ForCausalLM",)
    qkv_bias = True
    windows_per_layer = True

    def hf_unsupported(self, data: dict, where: Path) -> list[str]:
        # Qwen2's q/k/v biases are part of the architecture (no attention_bias key); mlp_bias does not exist.
        return [p for p in super().hf_unsupported(data, where) if not p.startswith("attention_bias")]

    def to_hf(self, m) -> dict:
        data = super().to_hf(m)
        del data["attention_bias"], data["mlp_bias"]  # not Qwen2Config keys: its q/k/v biases are fixed
        return data


SPEC = Qwen2Spec()
