"""LoRA adapters on the decoder's projections (torch side; names, shapes and checks: trainctl/core/lora.py).

`apply_lora` swaps each targeted nn.Linear of every block for a `LoRALinear` (on the meta device, before
parallelize) and freezes every parameter but the adapters. `LoRALinear` is an nn.Linear: its frozen `weight`
(and bias) keep their names, so Hugging Face loading, checkpoints and the export see the base model as always,
and FSDP2 shards the frozen weight and the trainable A and B of a block in one unit.
The routed experts of a mixture of experts (GroupedExperts) get an ExpertAdapter per targeted stacked weight
(`experts.gate_up`, `experts.down`), one A and B per expert, beside the frozen w1/w2/w3.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn
from torch.nn import functional

from trainctl.core import lora as spec
from trainctl.models.common.experts import ExpertAdapter, GroupedExperts
from trainctl.models.common.init import fill, rng_for


class LoRALinear(nn.Linear):
    """y = x W^T + b + scale * dropout(x) A^T B^T, W and b frozen; A kaiming-uniform, B zero (as peft)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, rank: int, alpha: float, dropout: float,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.rank, self.scale = rank, alpha / rank
        self.lora_a = nn.Parameter(torch.empty(rank, in_features, device=device, dtype=dtype))
        self.lora_b = nn.Parameter(torch.empty(out_features, rank, device=device, dtype=dtype))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = functional.linear(functional.linear(self.dropout(x), self.lora_a), self.lora_b)
        return super().forward(x) + self.scale * update

    @torch.no_grad()
    def reset_adapter(self) -> None:
        """peft's init: A as nn.Linear's default (kaiming-uniform, a=sqrt(5)), B zero, so training starts at W."""
        fill(self.lora_a, partial(nn.init.kaiming_uniform_, a=math.sqrt(5)))
        fill(self.lora_b, nn.init.zeros_)

    def merged_weight(self) -> torch.Tensor:
        return self.weight + self.scale * (self.lora_b @ self.lora_a)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, scale={self.scale:g}"


def _swap(parent: nn.Module, attr: str, lora) -> None:
    old = getattr(parent, attr)
    new = LoRALinear(old.in_features, old.out_features, old.bias is not None, lora.rank, lora.alpha, lora.dropout,
                     device=old.weight.device, dtype=old.weight.dtype)
    if old.weight.device.type != "meta":  # a model built with real weights keeps them
        with torch.no_grad():
            new.weight.copy_(old.weight)
            if old.bias is not None:
                new.bias.copy_(old.bias)
        new.reset_adapter()
    setattr(parent, attr, new)


def _attach_experts(experts: GroupedExperts, lora) -> None:
    """The experts' adapters (core/lora.py EXPERT_TARGETS): gate_up on w1|w3 (dim -> 2 hidden), down on w2."""
    e, dim, hidden = experts.w1.shape
    widths = {"expert_gate_up": (dim, 2 * hidden), "expert_down": (hidden, dim)}
    for target in spec.expert_targets(lora):
        adapter = ExpertAdapter(e, *widths[target], lora.rank, lora.alpha, device=experts.w1.device,
                                dtype=experts.w1.dtype)
        if experts.w1.device.type != "meta":
            reset_expert_adapter(adapter)
        setattr(experts, spec.EXPERT_TARGETS[target].rpartition(".")[2], adapter)


@torch.no_grad()
def reset_expert_adapter(adapter: ExpertAdapter) -> None:
    """peft's init per expert: A uniform in +-1/sqrt(in) (nn.Linear's default on its [r, in]), B zero."""
    bound = 1 / math.sqrt(adapter.lora_a.shape[1])
    fill(adapter.lora_a, partial(nn.init.uniform_, a=-bound, b=bound))
    fill(adapter.lora_b, nn.init.zeros_)


def apply_lora(model: nn.Module, lora) -> nn.Module:
    """Adapters on model.lora.targets of every block, everything else frozen; a no-op with rank 0."""
    if not spec.enabled(lora):
        return model
    for block in model.layers.values():
        for path in spec.target_paths(lora):
            parent_path, _, attr = path.rpartition(".")
            _swap(block.get_submodule(parent_path), attr, lora)
        if spec.expert_targets(lora):
            _attach_experts(block.get_submodule("feed_forward.experts"), lora)
    for name, param in model.named_parameters():
        param.requires_grad_(spec.is_adapter(name))
    return model


@torch.no_grad()
def init_adapters(model: nn.Module) -> None:
    """Initialize every adapter after materialization, each from its own stream (seed, its name): the same
    values whatever the sharding, as the base init does."""
    seed = torch.initial_seed()
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            with rng_for(f"lora:{_clean(name)}", seed, module.lora_a.device):
                module.reset_adapter()
        elif isinstance(module, ExpertAdapter):
            with rng_for(f"lora:{_clean(name)}", seed, module.lora_a.device):
                reset_expert_adapter(module)


def _clean(name: str) -> str:
    wrappers = ("module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
    return ".".join(p for p in name.split(".") if p not in wrappers)


def trainable_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
