"""The mixture-of-experts block that replaces a decoder block's MLP (qwen3_moe, mixtral).

    x [tokens, dim] -> router logits [tokens, E] -> top-k experts and their weights per token
    -> tokens sorted by expert (`counts` per expert) -> self.experts(x_sorted, counts) (GroupedExperts)
    -> each output row times its weight, added back at its token -> (+ a shared expert's SwiGLU)

Routers: `softmax_topk` (Qwen3-MoE): softmax over every expert, top-k, optionally renormalised over the k;
`topk_softmax` (Mixtral): top-k of the logits, softmax over the k (equal to softmax-top-k renormalised).
The experts are called only through `self.experts(x_sorted, counts)`, so expert parallelism can wrap that one
call with its all-to-all (train/parallel); `counts` is made here, by `dispatch`.

Load balancing (Switch / Mixtral form, as transformers' load_balancing_loss_func per layer):
aux = E * sum_e f_e * P_e, f_e = tokens routed to e / tokens, P_e = the mean router probability of e; the block
keeps `aux_loss_coef * aux / n_layers` of its last forward in `aux_loss`, so the model's auxiliary loss is the
sum over its blocks (the mean over layers times the coefficient). Counts, the imbalance and dropped tokens of
the last forward are in `load` (the loop logs them: train/loop/expert_load.py).

Capacity (capacity_factor > 0): each expert takes at most ceil(factor * tokens * k / E) of its tokens in
token order; the rest are dropped (their slot adds nothing; the residual carries the token). 0: no drop.
Aux-loss-free balancing (bias_update_rate > 0, DeepSeek-V3): a per-expert bias is added to the scores that
choose the experts (not to the weights); after each optimizer step it moves by the rate toward even load.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from trainctl.config.schema import ModelConfig
from trainctl.models.common.experts import GroupedExperts, local_weight
from trainctl.models.common.init import INIT_STD, fill, trunc_normal
from trainctl.models.common.layers import FeedForward, TransformerBlock


class Router(nn.Module):
    """The router's [E, dim] weight. Not an nn.Linear on purpose: float8 conversion (which swaps nn.Linear)
    leaves it alone, since the top-k choice is sensitive to rounding."""

    def __init__(self, dim: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, local_weight(self.weight))  # replicated over tp: its gradient Partial (experts.py)


class MoEBlock(TransformerBlock):
    """A decoder block whose MLP is the MoE block (same names otherwise: `feed_forward` holds the router,
    the experts and the shared expert)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.feed_forward = MoE(cfg)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.moe, self.n_layers = moe, cfg.n_layers
        self.router = Router(cfg.dim, moe.num_experts)
        self.experts = GroupedExperts(moe.num_experts, cfg.dim, moe.expert_ffn_dim)
        self.shared = FeedForward(cfg.dim, moe.shared_expert_ffn_dim) if moe.shared_expert_ffn_dim else None
        # Persistent: a resumed run routes as the saved one did.
        self.register_buffer("expert_bias", torch.zeros(moe.num_experts) if moe.bias_update_rate > 0 else None)
        self.aux_loss: torch.Tensor | None = None
        self.load: dict[str, torch.Tensor] | None = None
        # Under tensor parallelism (models/common/parallel.py: moe_block_plan) the tp group: each of its ranks routes
        # its own sequence-parallel share of every sequence. None: this rank routes whole sequences.
        self.token_group: dist.ProcessGroup | None = None

    def init_weights(self, out_std: float) -> None:
        trunc_normal(self.router.weight, INIT_STD)
        trunc_normal(self.experts.w1, INIT_STD)
        trunc_normal(self.experts.w3, INIT_STD)
        trunc_normal(self.experts.w2, out_std)
        if self.shared is not None:
            self.shared.init_weights(out_std)
        if self.expert_bias is not None:
            fill(self.expert_bias, nn.init.zeros_)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.router(x).float()
        probs, weights, chosen = route(logits, self.moe, self.expert_bias)
        order, counts, dropped = dispatch(chosen, self.moe.num_experts, self.capacity(x.shape[0]))
        token = order // chosen.shape[1]
        y = self.experts(x[token], counts)
        y = y * weights.reshape(-1)[order].unsqueeze(1).to(y.dtype)
        out = torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))
        if self.shared is not None:
            out = out + self.shared(x)
        self.keep_stats(probs, chosen, counts, dropped)
        return out.reshape(shape)

    def capacity(self, tokens: int) -> int | None:
        factor = self.moe.capacity_factor
        return math.ceil(factor * tokens * self.moe.experts_per_token / self.moe.num_experts) if factor else None

    def keep_stats(self, probs, chosen, counts, dropped) -> None:
        """The auxiliary loss and the expert load of this forward (an activation-checkpoint recompute writes
        the same values again).

        Under tensor parallelism the loss is over the micro-batch's tokens, as one process computes it: the
        routed fractions f are summed over the tp group (they carry no gradient), and each rank's term is its
        own tokens' share of the mean probabilities P, so the tp ranks' terms add up to E * sum f * P and each
        rank's gradient reaches only its own tokens (the router's is reduced over tp: experts.local_weight).
        The load (counts) stays this rank's: the step sums it over every rank (train/loop/expert_load.py).
        """
        self.load = {"counts": counts.detach(), "dropped": dropped.detach()}
        self.aux_loss = None
        if not self.moe.aux_loss_coef:
            return
        e = self.moe.num_experts
        routed = torch.bincount(chosen.reshape(-1), minlength=e).float()  # before any drop, as the router chose
        tokens = chosen.shape[0]
        if self.token_group is not None:
            routed = funcol.all_reduce(routed, "sum", self.token_group)
            tokens *= dist.get_world_size(self.token_group)  # sequence parallelism: equal shares
        aux = e * torch.sum(routed / tokens * (probs.sum(0) / tokens))
        self.aux_loss = self.moe.aux_loss_coef * aux / self.n_layers

    @torch.no_grad()
    def update_bias(self, counts: torch.Tensor) -> None:
        """Aux-loss-free balancing: overloaded experts' bias down, underloaded up, by the rate (counts: the
        step's tokens per expert over every rank, so every rank moves its bias alike)."""
        if self.expert_bias is None:
            return
        step = self.moe.bias_update_rate * torch.sign(counts.float().mean() - counts.float())
        bias = self.expert_bias
        local = bias.to_local() if hasattr(bias, "to_local") else bias
        local.add_(step.to(local.device, local.dtype))


def route(logits: torch.Tensor, moe, bias: torch.Tensor | None = None):
    """(probs over every expert [T, E], the chosen experts' weights [T, k], their indices [T, k]), fp32.

    A balancing bias shifts which experts are chosen, never their weights."""
    k = moe.experts_per_token
    probs = torch.softmax(logits, dim=-1)
    scores = probs if moe.router == "softmax_topk" else logits
    if bias is not None:
        _, chosen = torch.topk(scores + bias.to(scores.dtype), k, dim=-1)
        top = scores.gather(1, chosen)
    else:
        top, chosen = torch.topk(scores, k, dim=-1)
    if moe.router == "topk_softmax":
        weights = torch.softmax(top, dim=-1)
    else:
        weights = top / top.sum(-1, keepdim=True) if moe.norm_topk_prob else top
    return probs, weights, chosen


def dispatch(chosen: torch.Tensor, num_experts: int, capacity: int | None):
    """(the slots of chosen.reshape(-1) in expert order, tokens per expert kept, tokens dropped).

    A stable sort keeps each expert's tokens in token order, so a capacity keeps the earliest ones."""
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    if capacity is None:
        return order, counts, counts.new_zeros(())
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    kept = counts.clamp(max=capacity)
    return order[rank_in_expert < capacity], kept, (counts - kept).sum()


def moe_blocks(model: nn.Module) -> list[tuple[str, MoE]]:
    """Every MoE block of `model` (wrapped or not) with its layer key, in order."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            parts = name.split(".")
            layer = next((parts[i + 1] for i, p in enumerate(parts[:-1]) if p == "layers"), name)
            found.append((layer, module))
    return found

