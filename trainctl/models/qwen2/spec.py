"""The qwen2 family (Qwen 2 and 2.5) without torch: the llama layout with biases on the q, k and v projections.

The q and k biases are rotary rows like their weights (reordered between trainctl's interleaved pairs and
transformers' halves); the v bias is not. Per-layer sliding windows (use_sliding_window) are refused.
"""

from __future__ import annotations

from pathlib import Path

from trainctl.models.common.shape import DecoderSpec
from trainctl.models.registry import HFConfigError, flag


class Qwen2Spec(DecoderSpec):
    family = "qwen2"
    hf_model_types = ("qwen2",)
    hf_architectures = ("Qwen2ForCausalLM",)
    qkv_bias = True

    def _hf_window(self, data: dict, where: Path) -> int:
        """Qwen's window applies only with use_sliding_window, and then per layer (from max_window_layers)."""
        if flag(where, data, "use_sliding_window", False):
            raise HFConfigError(f"{where}: use_sliding_window=true (sliding windows on some layers) is not "
                                "implemented; trainctl's qwen attends to the whole sequence")
        return 0

    def hf_unsupported(self, data: dict, where: Path) -> list[str]:
        # Qwen2's q/k/v biases are part of the architecture (no attention_bias key); mlp_bias does not exist.
        return [p for p in super().hf_unsupported(data, where) if not p.startswith("attention_bias")]

    def hf_extra(self, m) -> dict:
        return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": m.n_layers}

    def to_hf(self, m) -> dict:
        data = super().to_hf(m)
        del data["attention_bias"], data["mlp_bias"]  # not Qwen2Config keys: its q/k/v biases are fixed
        return data


SPEC = Qwen2Spec()
