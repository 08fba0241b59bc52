"""The qwen3_moe family (Qwen3-MoE: Qwen3-30B-A3B, Qwen3-235B-A22B) without torch: qwen3's attention (per-head q/k
norms) and a mixture-of-experts MLP in every block, routed softmax-then-top-k (`norm_topk_prob` renormalises
the k weights), no shared expert. config.json's decoder_sparse_step must be 1 and mlp_only_layers empty (every
block sparse, as the published models are); other layouts are refused by name.
"""

from __future__ import annotations

from pathlib import Path

from trainctl.models.common.moe_shape import MoEShape
from trainctl.models.common.shape import QKNormShape
from trainctl.models.registry import HFConfigError, flag, shown


class Qwen3MoESpec(MoEShape, QKNormShape):
    family = "qwen3_moe"
    hf_model_types = ("qwen3_moe",)
    hf_architectures = ("Qwen3MoeForCausalLM",)
    hf_block_names = {**QKNormShape.hf_block_names, "feed_forward.router": "mlp.gate"}

    def from_hf(self, data: dict, where: Path) -> dict:
        fields = super().from_hf(data, where)
        if data.get("decoder_sparse_step", 1) != 1 or data.get("mlp_only_layers") not in (None, []):
            raise HFConfigError(f"{where}: decoder_sparse_step={shown(data.get('decoder_sparse_step', 1))}, "
                                f"mlp_only_layers={shown(data.get('mlp_only_layers'))}: dense layers between the "
                                "sparse ones are not implemented; trainctl's qwen3_moe makes every block sparse")
        # The Hub's files say num_experts; transformers >= 5 writes num_local_experts.
        experts_key = "num_experts" if "num_experts" in data else "num_local_experts"
        moe = self.from_hf_moe(data, where, experts_key, "moe_intermediate_size")
        moe["norm_topk_prob"] = flag(where, data, "norm_topk_prob", False)
        return {**fields, "moe": moe}

    def hf_extra(self, m) -> dict:
        return {**super().hf_extra(m), "num_experts": m.moe.num_experts, "num_experts_per_tok": m.moe.experts_per_token,
                "moe_intermediate_size": m.moe.expert_ffn_dim, "norm_topk_prob": m.moe.norm_topk_prob,
                "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": m.moe.aux_loss_coef}


SPEC = Qwen3MoESpec()
