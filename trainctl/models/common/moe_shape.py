"""The mixture-of-experts decoder's shape without torch (qwen3_moe, mixtral): tensors, counts, FLOPs, activations,
config checks and the Hugging Face names of the experts.

A block's MLP is the MoE block (models/common/moe.py): the router [E, dim]; the routed experts as three stacked
weights w1, w3 [E, dim, hidden] and w2 [E, hidden, dim]; an optional shared SwiGLU expert. A stacked weight is a
Tensor of rows = E (dim 0, the one FSDP2 shards and expert parallelism splits) and cols = the product of the rest.

Counts: `param_count` is every parameter; `active_param_count` what one token uses (k of the E routed experts).
FLOPs per token count only the active matmuls (the router and k experts), as MFU's numerator should.

Hugging Face names: the Hub (and transformers' save_pretrained) keeps one tensor per expert and projection,
`model.layers.N.<moe>.experts.<e>.<proj>.weight` ([out, in]: ours transposed); transformers >= 5 holds them fused
in memory (`mlp.experts.gate_up_proj` [E, 2 hidden, dim], `mlp.experts.down_proj` [E, dim, hidden]).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from trainctl.core.tensors import Tensor
from trainctl.models.common.shape import FP32
from trainctl.models.registry import HFConfigError, size

EXPERT_WEIGHTS = ("w1", "w2", "w3")
ROUTERS = ("softmax_topk", "topk_softmax")


class MoEShape:
    """Mixed into a DecoderSpec subclass (before it): the MoE MLP in place of the dense one."""

    is_moe = True  # what config's checks ask (config does not import this module)
    hf_moe_module = "mlp"  # the block's MoE module in Hub names (Mixtral's: block_sparse_moe)
    hf_router = "gate"
    hf_experts = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}  # ours -> the Hub's per-expert names
    router = "softmax_topk"  # the family's routing (model.moe.router must name it)
    # Tensor parallelism splits attention only; the MoE MLP (router, experts) is refused under tp (config/moe_check)
    tp_colwise = ("wq", "wk", "wv", "output", "tok_embeddings")
    tp_rowwise = ("wo",)

    # ---- shape ----
    def mlp_tensors(self, m, p: str) -> list[Tensor]:
        """The MoE MLP's parameters in registration order (p = layers.N.feed_forward.)."""
        e, h = m.moe.num_experts, m.moe.expert_ffn_dim
        tensors = [Tensor(p + "router.weight", e, m.dim),
                   *(Tensor(p + f"experts.{w}", e, m.dim * h) for w in EXPERT_WEIGHTS)]
        s = m.moe.shared_expert_ffn_dim
        if s:
            tensors += [Tensor(p + "shared.w1.weight", s, m.dim), Tensor(p + "shared.w2.weight", m.dim, s),
                        Tensor(p + "shared.w3.weight", s, m.dim)]
        return tensors

    def block_tensors(self, m, index: int) -> list[Tensor]:
        p = f"layers.{index}."
        return [Tensor(p + "attention_norm.weight", m.dim, 1), *self.attention_tensors(m, p + "attention."),
                Tensor(p + "ffn_norm.weight", m.dim, 1), *self.mlp_tensors(m, p + "feed_forward.")]

    def linear_shapes(self, m) -> dict[str, tuple[int, int]]:
        """nn.Linear-like matmuls (in, out) of one block: not the stacked experts, not the router (not Linears)."""
        return {name: shape for name, shape in super().linear_shapes(m).items()
                if not name.startswith(("feed_forward.experts", "feed_forward.router"))}

    def lora_shapes(self, m) -> dict[str, tuple[int, int]]:
        """The matmuls plus one routed expert's LoRA targets (core/lora.py EXPERT_TARGETS): the fused gate and up
        (dim -> 2 hidden, as transformers' gate_up_proj) and down (hidden -> dim)."""
        h = m.moe.expert_ffn_dim
        return {**super().lora_shapes(m), "feed_forward.experts.gate_up": (m.dim, 2 * h),
                "feed_forward.experts.down": (h, m.dim)}

    # ---- counts and FLOPs ----
    def expert_params(self, m) -> int:
        """One routed expert's parameters (w1, w2, w3)."""
        return 3 * m.dim * m.moe.expert_ffn_dim

    def active_param_count(self, m) -> int:
        """Parameters one token uses: all but the E - k routed experts it skips in every layer."""
        idle = m.moe.num_experts - m.moe.experts_per_token
        return self.param_count(m) - m.n_layers * idle * self.expert_params(m)

    def matmul_params(self, m) -> int:
        idle = m.moe.num_experts - m.moe.experts_per_token
        return super().matmul_params(m) - m.n_layers * idle * self.expert_params(m)

    # ---- activation bytes per token of one block ----
    def dense_view(self, m):
        """The dense block whose MLP activations equal the routed ones: k experts (+ the shared one) per token."""
        return replace(m, ffn_dim=m.moe.experts_per_token * m.moe.expert_ffn_dim + m.moe.shared_expert_ffn_dim)

    def routing_bytes(self, m, lay) -> float:
        """What routing keeps per token: fp32 logits and probabilities over E, and k copies of the token going
        to the experts and of their weighted outputs (the sort's gather, the combine's scatter)."""
        return (2 * FP32 * m.moe.num_experts + 2 * lay.compute_bytes * m.moe.experts_per_token * m.dim) / lay.tp

    def block_none(self, m, lay) -> float:
        return super().block_none(self.dense_view(m), lay) + self.routing_bytes(m, lay)

    def block_compiled(self, m, lay) -> float:
        return super().block_compiled(self.dense_view(m), lay) + self.routing_bytes(m, lay)

    def block_op(self, m, lay) -> float:
        return super().block_op(self.dense_view(m), lay) + self.routing_bytes(m, lay)

    def block_grad_bytes(self, m, lay) -> float:
        return super().block_grad_bytes(self.dense_view(m), lay)

    # ---- checks ----
    def tp_divides(self, m) -> dict[str, int]:
        return {"n_heads": m.n_heads, "n_kv_heads": m.n_kv_heads, "dim": m.dim}

    def problems(self, m, seq_len: int) -> list[str]:
        moe, problems = m.moe, super().problems(m, seq_len)
        if moe.num_experts < 1:
            return [*problems, f"model.moe.num_experts={moe.num_experts}: model.family={self.family} is a mixture "
                               "of experts; set model.moe.num_experts (e.g. 8) and model.moe.experts_per_token"]
        if moe.experts_per_token > moe.num_experts:
            problems.append(f"model.moe.experts_per_token={moe.experts_per_token}: more than model.moe.num_experts="
                            f"{moe.num_experts}; use at most {moe.num_experts}")
        if moe.router != self.router:
            problems.append(f"model.moe.router={moe.router!r}: {self.family} routes with {self.router!r}; use it")
        mlp = [t for t in m.lora.targets if t in ("gate", "up", "down")] if m.lora.rank else []
        if mlp:
            problems.append(f"model.lora.targets={m.lora.targets}: {self.family} has no dense MLP ({', '.join(mlp)}); "
                            "adapt its routed experts with expert_gate_up and expert_down, and attention with q, k, "
                            "v, o")
        if moe.shared_expert_ffn_dim:
            problems.append(f"model.moe.shared_expert_ffn_dim={moe.shared_expert_ffn_dim}: {self.family} has no "
                            "shared expert (its Hugging Face class has none); use 0")
        return problems

    # ---- Hugging Face config.json ----
    def from_hf_moe(self, data: dict, where: Path, experts_key: str, ffn_key: str) -> dict:
        """model.moe of a config.json (the caller adds the family's own keys)."""
        experts, k = size(where, data, experts_key), size(where, data, "num_experts_per_tok")
        if k > experts:
            raise HFConfigError(f"{where}: num_experts_per_tok={k} exceeds {experts_key}={experts}")
        # The training knobs (aux_loss_coef, capacity_factor, bias_update_rate) stay the user's.
        return {"num_experts": experts, "experts_per_token": k, "expert_ffn_dim": size(where, data, ffn_key),
                "router": self.router, "shared_expert_ffn_dim": 0}

    # ---- Hugging Face tensor names ----
    def expert_parts(self, name: str) -> tuple[str, str] | None:
        """(layer, our weight) of a stacked expert tensor `layers.N.feed_forward.experts.wK`, else None."""
        parts = name.split(".")
        if len(parts) == 5 and parts[0] == "layers" and parts[2:4] == ["feed_forward", "experts"] \
                and parts[4] in EXPERT_WEIGHTS:
            return parts[1], parts[4]
        return None

    def expert_hf_tensors(self, name: str, m) -> list[tuple[str, list[int]]] | None:
        """The Hub's per-expert tensors (name, [out, in]) that one stacked expert weight is, else None."""
        found = self.expert_parts(name)
        if found is None:
            return None
        layer, ours = found
        h = m.moe.expert_ffn_dim
        shape = [m.dim, h] if ours == "w2" else [h, m.dim]
        return [(f"model.layers.{layer}.{self.hf_moe_module}.experts.{e}.{self.hf_experts[ours]}.weight", shape)
                for e in range(m.moe.num_experts)]

    def from_hf_expert(self, name: str) -> tuple[str, int] | None:
        """(our stacked tensor, expert index) of a Hub per-expert tensor, else None."""
        parts = name.split(".")
        back = {theirs: ours for ours, theirs in self.hf_experts.items()}
        if len(parts) == 8 and parts[:2] == ["model", "layers"] and parts[2].isdigit() \
                and parts[3:5] == [self.hf_moe_module, "experts"] and parts[5].isdigit() \
                and parts[6] in back and parts[7] == "weight":
            return f"layers.{parts[2]}.feed_forward.experts.{back[parts[6]]}", int(parts[5])
        return None

    def hub_names_of_fused(self, name: str, tensor) -> list[tuple[str, object]] | None:
        """transformers >= 5's in-memory MoE tensor under the Hub's names, else None: the fused experts
        (`...mlp.experts.gate_up_proj` [E, 2h, dim]: gate rows then up rows; `...mlp.experts.down_proj`) split per
        expert, and the router (Mixtral's in memory is `mlp.gate`, on the Hub `block_sparse_moe.gate`)."""
        parts = name.split(".")
        if len(parts) == 6 and parts[:2] == ["model", "layers"] and parts[3:] == ["mlp", self.hf_router, "weight"]:
            return [(f"model.layers.{parts[2]}.{self.hf_moe_module}.{self.hf_router}.weight", tensor)]  # mixtral's
        if len(parts) != 6 or parts[:2] != ["model", "layers"] or parts[3:5] != ["mlp", "experts"]:
            return None
        prefix = f"model.layers.{parts[2]}.{self.hf_moe_module}.experts"
        if parts[5] == "down_proj":
            return [(f"{prefix}.{e}.{self.hf_experts['w2']}.weight", tensor[e]) for e in range(tensor.shape[0])]
        if parts[5] != "gate_up_proj":
            return None
        h = tensor.shape[1] // 2
        return [(f"{prefix}.{e}.{self.hf_experts[w]}.weight", tensor[e, rows])
                for e in range(tensor.shape[0]) for w, rows in (("w1", slice(0, h)), ("w3", slice(h, 2 * h)))]
