"""The mixtral family (Mixtral 8x7B, 8x22B) without torch: mistral's attention and a mixture-of-experts MLP in
every block, routed top-k-then-softmax over the k, no shared expert. The Hub names the MoE module
`block_sparse_moe` and the experts' projections w1 (gate), w2 (down), w3 (up); intermediate_size is each
expert's hidden size. A sliding window is refused unless it covers train.seq_len (as mistral's).
"""

from __future__ import annotations

from pathlib import Path

from trainctl.models.common.moe_shape import MoEShape
from trainctl.models.common.shape import DecoderSpec
from trainctl.models.registry import HFConfigError, shown


class MixtralSpec(MoEShape, DecoderSpec):
    family = "mixtral"
    hf_model_types = ("mixtral",)
    hf_architectures = ("MixtralForCausalLM",)
    hf_moe_module = "block_sparse_moe"
    hf_experts = {"w1": "w1", "w2": "w2", "w3": "w3"}
    router = "topk_softmax"
    hf_block_names = {**DecoderSpec.hf_block_names, "feed_forward.router": "block_sparse_moe.gate"}

    def from_hf(self, data: dict, where: Path) -> dict:
        fields = super().from_hf(data, where)
        if data.get("router_jitter_noise", 0) not in (0, 0.0, None):
            raise HFConfigError(f"{where}: router_jitter_noise={shown(data['router_jitter_noise'])}: not "
                                "implemented; trainctl's mixtral routes without jitter (set it to 0)")
        moe = self.from_hf_moe(data, where, "num_local_experts", "intermediate_size")
        return {**fields, "moe": moe}

    def to_hf(self, m) -> dict:
        data = super().to_hf(m)
        del data["attention_bias"], data["mlp_bias"]  # not MixtralConfig keys
        return data

    def hf_extra(self, m) -> dict:
        return {"sliding_window": m.sliding_window or None, "num_local_experts": m.moe.num_experts,
                "num_experts_per_tok": m.moe.experts_per_token, "intermediate_size": m.moe.expert_ffn_dim,
                "router_aux_loss_coef": m.moe.aux_loss_coef, "router_jitter_noise": 0.0}


SPEC = MixtralSpec()
