"""The qwen3 family (dense Qwen 3) without torch: the llama layout with an RMSNorm over each q and k head
before RoPE, and a head_dim that need not be hidden / heads (Qwen3 0.6B: 16 heads of 128 on a 1024 stream).

The per-head norm weights are reordered like one rotary head (trainctl's interleaved pairs vs transformers'
halves): the norm itself does not care about the order of a head's elements, its weight must follow it.
"""

from __future__ import annotations

from pathlib import Path

from trainctl.models.llama.spec import LlamaSpec
from trainctl.models.registry import HFConfigError, flag


class Qwen3Spec(LlamaSpec):
    family = "qwen3"
    hf_model_types = ("qwen3",)
    hf_architectures = ("Qwen3ForCausalLM",)
    qk_norm = True
    hf_block_names = {**LlamaSpec.hf_block_names,
                      "attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm"}

    def _hf_window(self, data: dict, where: Path) -> int:
        """Qwen's window applies only with use_sliding_window, and then per layer (from max_window_layers)."""
        if flag(where, data, "use_sliding_window", False):
            raise HFConfigError(f"{where}: use_sliding_window=true (sliding windows on some layers) is not "
                                "implemented; trainctl's qwen3 attends to the whole sequence")
        return 0

    def hf_extra(self, m) -> dict:
        return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": m.n_layers}

    def to_hf(self, m) -> dict:
        data = super().to_hf(m)
        del data["mlp_bias"]  # not a Qwen3Config key
        return data


SPEC = Qwen3Spec()
