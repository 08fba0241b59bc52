"""Activation memory: checkpointing modes (what to recompute in backward) and offload to host.

`train.activation_checkpointing`:
  none       keep every activation autograd saves.
  full       wrap every block: keep only its input, recompute the block in backward.
  selective  wrap every `train.ac_every`-th block (a memory/compute dial between none and full).
  op         per-op selective checkpointing on every block: keep the outputs of matmuls and
             attention (expensive to recompute), recompute the pointwise ops around them
             (norms, RoPE, SiLU, residual adds: cheap, and together as large as the matmul outputs).
`train.activation_offload`: saved tensors move to host memory as they are saved and come back
in backward (torch's save_on_cpu). Tensors saved inside a checkpointed region are not offloaded:
checkpointing's own saved-tensor hooks take precedence there (they keep nothing to offload).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts


def transformer_blocks(model: nn.Module) -> nn.ModuleDict:
    return model.layers


def _aten_overloads(*names: str) -> frozenset:
    """The default overloads of the named aten ops that exist in this torch build."""
    ops = (getattr(torch.ops.aten, name, None) for name in names)
    return frozenset(op.default for op in ops if op is not None)


# Ops whose outputs the `op` mode keeps: matmuls (nn.Linear lowers to mm/addmm, batched ones to bmm) and fused
# attention kernels, whose recomputation would redo most of the forward's FLOPs; and the float8 scales' amax
# reductions (max, amax: a few bytes each, as torchtitan keeps them). A torchao float8 Linear shows this policy
# aten.mm on its float8 subclass, whatever it runs below (torch._scaled_mm): keeping mm keeps its output, so
# _scaled_mm, which no policy ever sees, is not listed (tests/unit/test_op_checkpointing.py counts both).
SAVED_OPS = _aten_overloads(
    "mm", "addmm", "bmm", "max", "amax",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)


def save_matmuls_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective-checkpoint policy: must save matmul/attention outputs, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def op_level_contexts():
    """Fresh (forward, recompute) contexts for one checkpointed call under `save_matmuls_policy`."""
    return create_selective_checkpoint_contexts(save_matmuls_policy)


def checkpoint_block(block: nn.Module, mode: str) -> nn.Module:
    """The block wrapped for recomputation (non-reentrant); `op` adds the per-op save policy."""
    # preserve_rng_state=False: the blocks draw no random numbers (no dropout).
    if mode == "op":
        return checkpoint_wrapper(block, preserve_rng_state=False, context_fn=op_level_contexts)
    return checkpoint_wrapper(block, preserve_rng_state=False)


def blocks_to_checkpoint(mode: str, n_blocks: int, every: int) -> list[int]:
    """Indices of the blocks a mode wraps: all (full, op), every `every`-th (selective), none."""
    if mode in ("full", "op"):
        return list(range(n_blocks))
    if mode == "selective":
        return [i for i in range(n_blocks) if (i + 1) % every == 0]
    return []


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int) -> None:
    """Wrap the blocks `mode` selects (see module doc) in place, keeping their names."""
    blocks = transformer_blocks(model)
    names = list(blocks.keys())
    for index in blocks_to_checkpoint(mode, len(names), every):
        blocks[names[index]] = checkpoint_block(blocks[names[index]], mode)


def activation_offload(enabled: bool, device: torch.device) -> contextlib.AbstractContextManager:
    """Context for one forward: saved activations go to host memory until backward (when enabled).

    Pinned host buffers on CUDA make the copies asynchronous; on a CPU device the tensors are
    already in host memory and `save_on_cpu` keeps them as they are.
    """
    if not enabled:
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")

