"""DPO's reference model, computed on the fly.

With LoRA (model.lora.rank > 0) the reference is the policy itself with its adapters switched off, as peft's
`disable_adapter()`: the frozen base weights are the starting model, so no second copy exists. Switching off
sets each LoRALinear's scale to 0 for the forward (the update term is then exactly zero) and back after.

Without LoRA the reference is a frozen copy of the starting weights, built as the policy is (tensor parallel
and FSDP2-sharded like it, so each rank holds its share; replicated where the policy is replicated, without a
DDP wrapper: it has no gradients) and never checkpointed: a fresh run copies the policy's weights after they
were loaded (seeded init, checkpoint.init_from or a model-only checkpoint.resume), a resumed one rebuilds them
from the seeded init and checkpoint.init_from (validation refuses the case it could not rebuild).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from trainctl.config.schema import RunConfig
from trainctl.core.wrapping import wrapping_of
from trainctl.models.build import build_model
from trainctl.models.lora import LoRALinear
from trainctl.train.parallel.parallelize import apply_fsdp, dp_mesh_for, materialize, unwrap
from trainctl.train.parallel.precision import fsdp_mp_policy
from trainctl.train.parallel.tensor_parallel import apply_tp


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """The base model: every LoRA adapter's contribution scaled to zero for the duration."""
    lora = [m for m in model.modules() if isinstance(m, LoRALinear)]
    scales = [m.scale for m in lora]
    for m in lora:
        m.scale = 0.0
    try:
        yield
    finally:
        for m, scale in zip(lora, scales, strict=True):
            m.scale = scale


def frozen_copy(cfg: RunConfig, mesh, device: torch.device) -> nn.Module:
    """A new model with the policy's layout and the seeded init, every parameter frozen (module doc)."""
    model = build_model(cfg.model, "meta")
    wrap = wrapping_of(cfg.sharding, cfg.precision)
    if cfg.sharding.tp > 1:
        apply_tp(model, mesh["tp"])
    if wrap.fsdp:
        apply_fsdp(model, dp_mesh_for(wrap.dp_mesh, mesh), wrap.reshard_after_forward, fsdp_mp_policy(wrap),
                   cfg.sharding.cpu_offload)
    materialize(model, device, cfg.sharding.cpu_offload)
    return model.requires_grad_(False).eval()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (a plain tensor is its own)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@torch.no_grad()
def copy_weights(reference: nn.Module, policy: nn.Module) -> None:
    """The policy's current parameters into the reference, shard by shard: the same build gives the same names and
    local shards (FSDP2's and TP's); the policy's DDP-over-TP replication adds a mesh dimension, not a shard."""
    own = dict(unwrap(policy).named_parameters())
    for name, param in reference.named_parameters():
        _local(param).copy_(_local(own[name]))
