"""The llama family without torch (Llama 2, 3, 3.1, 3.2): the shared decoder's shape as it is."""

from __future__ import annotations

from trainctl.models.common.shape import DecoderSpec


class LlamaSpec(DecoderSpec):
    family = "llama"
    hf_model_types = ("llama",)
    hf_architectures = ("LlamaForCausalLM",)


SPEC = LlamaSpec()
