"""The qwen3 family (dense Qwen 3) without torch: the llama layout with an RMSNorm over each q and k head
before RoPE, and a head_dim that need not be hidden / heads (Qwen3 0.6B: 16 heads of 128 on a 1024 stream).

The per-head norm weights are reordered like one rotary head (trainctl's interleaved pairs vs transformers'
halves): the norm itself does not care about the order of a head's elements, its weight must follow it.
"""

from __future__ import annotations

from trainctl.core.tensors import Tensor
from trainctl.models.common.shape import FP32, DecoderSpec


class Qwen3Spec(DecoderSpec):
    family = "qwen3"
    hf_model_types = ("qwen3",)
    hf_architectures = ("Qwen3ForCausalLM",)
    windows_per_layer = True
    hf_block_names = {**DecoderSpec.hf_block_names,
                      "attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm"}

    def attention_tensors(self, m, p: str) -> list[Tensor]:
        """llama's, then the q and k norm weights (registered after wo)."""
        return [*super().attention_tensors(m, p), *(Tensor(p + f"{n}_norm.weight", self.head_dim(m), 1)
                                                     for n in ("q", "k"))]

    def attention_norm_bytes(self, m, lay, compiled: bool = False) -> float:
        """Each q and k head's RMSNorm keeps its fp32 input and x * rstd (input only when fused) and one rstd;
        compiled, only the rstd (Inductor recomputes the rest from the projections' outputs)."""
        heads = m.n_heads + m.n_kv_heads
        per_element = 0 if compiled else (4 if lay.fused_norm else 8)
        return (per_element * heads * self.head_dim(m) + FP32 * heads) / lay.tp

    def rotary_heads(self, name: str, m) -> int | None:
        """q/k norm weights are one head's worth of rotary rows: reordered as q and k are."""
        if name.startswith("layers.") and name.endswith(("q_norm.weight", "k_norm.weight")):
            return 1
        return super().rotary_heads(name, m)

    def to_hf(self, m) -> dict:
        data = super().to_hf(m)
        del data["mlp_bias"]  # not a Qwen3Config key
        return data


SPEC = Qwen3Spec()
