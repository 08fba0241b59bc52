"""Measured memory of one rank: model states (weights, gradients, optimizer states) and activations.

Bytes are counted from the tensors themselves (numel x element size of the LOCAL data: a
DTensor counts its shard), so they mean the same on CPU and CUDA and need no allocator.
The trainer logs `model_state_bytes` once, after an early optimizer step (the third) and
before zero_grad: that is the moment every state exists at once (gradients are still there,
AdamW has allocated its moments), and between steps FSDP2 keeps only the shards. The same
record carries that step's measured peak (trainctl/train/observe/peak_memory.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank stores (a DTensor's shard)."""
    return t.to_local() if isinstance(t, DTensor) else t


def tensor_bytes(t: torch.Tensor) -> int:
    local = local_tensor(t)
    if hasattr(local, "__tensor_flatten__"):  # a wrapper subclass (torchao's quantized optimizer states): its parts
        inner, _ = local.__tensor_flatten__()
        return sum(tensor_bytes(getattr(local, name)) for name in inner)
    return local.numel() * local.element_size()


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's states (ZeroRedundancyOptimizer keeps them in `.optim`)."""
    return getattr(optimizer, "optim", optimizer)


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of this rank's optimizer state (AdamW: exp_avg, exp_avg_sq and the scalar step)."""
    states = local_optimizer(optimizer).state.values()
    return [v for state in states for v in state.values() if isinstance(v, torch.Tensor)]


def _on_cpu(tensors: Iterable[torch.Tensor]) -> int:
    return sum(tensor_bytes(t) for t in tensors if local_tensor(t).device.type == "cpu")


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank stores for parameters, gradients and optimizer states; `host_bytes`: those in CPU memory."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    states = optimizer_state_tensors(optimizer)
    return {
        "params_bytes": sum(map(tensor_bytes, params)),
        "grads_bytes": sum(map(tensor_bytes, grads)),
        "optimizer_bytes": sum(map(tensor_bytes, states)),
        "host_bytes": _on_cpu(params) + _on_cpu(grads) + _on_cpu(states),
    }


def gather_per_rank(values: dict) -> list[dict]:
    """Every rank's `values`, in rank order, on every rank (a collective: call on all ranks)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [values]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, values)
    return out


def memory_record(model: nn.Module, optimizer: torch.optim.Optimizer, peak: dict | None = None) -> dict:
    """The `kind: memory` metrics of this job: the busiest rank's bytes per state, and each rank's.

    `peak`: this rank's measured step peak (peak_memory.PeakMeter.stop), kept per rank too.
    """
    per_rank = gather_per_rank({**model_state_bytes(model, optimizer), **(peak or {})})
    busiest = {key: max(r[key] for r in per_rank) for key in per_rank[0] if isinstance(per_rank[0][key], int)}
    return {**busiest, **{k: v for k, v in per_rank[0].items() if isinstance(v, str)}, "per_rank": per_rank}


# ---- activations -------------------------------------------------------------------------


def _storage_key(t: torch.Tensor) -> tuple:
    storage = t.untyped_storage()
    return (storage.device.type, storage.data_ptr(), storage.nbytes())


def saved_tensor_bytes(fn: Callable[[], object], exclude: Iterable[torch.Tensor] = ()) -> tuple[object, int]:
    """Run `fn` under saved-tensor hooks; returns (its result, bytes of the distinct storages autograd saved).

    Only what autograd's own pack hook sees is counted: inside a non-reentrant checkpoint the
    checkpoint's hooks take over (they save nothing), and what checkpointing keeps by other
    means (the block input, the selective-checkpoint cache) is invisible here: see
    `retained_activation_bytes` for that. Storages of `exclude` (the parameters) are skipped.
    """
    skip = {_storage_key(local_tensor(t)) for t in exclude}
    seen: dict[tuple, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        local = local_tensor(t)
        key = _storage_key(local)
        if key not in skip:
            seen[key] = local.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, sum(seen.values())


class _StorageTracker(TorchDispatchMode):
    """Remembers (weakly) the storage of every tensor an op produces, except the `exclude`d ones."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.skip = {_storage_key(local_tensor(t)) for t in exclude}
        self.storages: dict[tuple, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._remember(local_tensor(t))
        return out

    def _remember(self, t: torch.Tensor) -> None:
        key = _storage_key(t)
        known = self.storages.get(key)
        # A freed storage's address and size can come back for a new one: the old entry is dead then.
        if key not in self.skip and (known is None or known[0].expired()):
            storage = t.untyped_storage()
            self.storages[key] = (StorageWeakRef(storage), storage.nbytes())

    def alive_bytes(self) -> int:
        return sum(nbytes for ref, nbytes in self.storages.values() if not ref.expired())


def retained_activation_bytes(fn: Callable[[], object], exclude: Iterable[torch.Tensor] = ()) -> tuple[object, int]:
    """Run `fn` (a forward + loss); returns (its result, bytes of the storages it created that are still alive).

    With the result held and no backward run yet, what stays alive is what the autograd graph
    keeps for backward, whoever keeps it: saved tensors, checkpointed blocks' inputs, the
    selective-checkpoint cache, and the result itself. Views of the `exclude`d tensors (the
    parameters and buffers: a transposed weight, a slice of the RoPE table) are not counted.
    """
    tracker = _StorageTracker(exclude)
    with tracker:
        result = fn()
    return result, tracker.alive_bytes()
