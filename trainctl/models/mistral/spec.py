"""The mistral family without torch: the llama layout (Mistral 7B v0.1 to v0.3, Mistral NeMo's head_dim).

Mistral 7B v0.1 attends within a 4096-token sliding window; trainctl attends to the whole sequence, which is
the same computation when the window covers train.seq_len, and refused otherwise (validate, one line naming
model.sliding_window).
"""

from __future__ import annotations

from trainctl.models.common.shape import DecoderSpec


class MistralSpec(DecoderSpec):
    family = "mistral"
    hf_model_types = ("mistral",)
    hf_architectures = ("MistralForCausalLM",)

    def hf_extra(self, m) -> dict:
        return {"sliding_window": m.sliding_window or None}

    def to_hf(self, m) -> dict:
        data = super().to_hf(m)
        del data["attention_bias"], data["mlp_bias"]  # not MistralConfig keys
        return data


SPEC = MistralSpec()
