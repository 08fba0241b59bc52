"""Context parallelism: each cp rank holds a slice of every sequence; attention still sees all of it.

torch's `context_parallel` (ring attention) shards the step's buffers along the sequence
dim in place and swaps scaled_dot_product_attention for a ring version that passes key/value
slices between the cp ranks. Its ring kernels replace only CUDA's flash, memory-efficient
and cuDNN SDPA ops (and FlexAttention has no CPU backward), so context parallelism runs on
CUDA only; `validate` refuses it elsewhere before launch.

What the rest of the worker does for cp > 1:
- buffers: the tokens, the targets and the RoPE rows of a micro-batch are sharded together, with
  torch's head-tail load balancing (rank r keeps chunks r and 2cp-1-r of 2cp, so causal work
  is even); the RoPE rows travel with their tokens, so every token keeps its true position.
- loss: each cp rank divides its summed loss by the tokens *it* holds; the mean over cp ranks
  of those local means is the global mean.
- gradients: parameters are the same on every cp rank, so FSDP shards over dp_shard x cp
  (DDP replicates over dp x cp), and the gradient average over that group includes cp.
- data: cp ranks read the same batch (dp_coordinates ignores cp).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from trainctl.train.errors import WorkerConfigError


def check_cp_device(cp: int, device: torch.device) -> None:
    """The live-world half of validate's check: ring attention needs CUDA SDPA kernels."""
    if cp > 1 and device.type != "cuda":
        raise WorkerConfigError(
            f"sharding.cp={cp}: context parallelism needs CUDA attention kernels (torch's context_parallel), "
            f"this worker runs on {device.type}; use sharding.cp=1"
        )


def cp_mesh_of(mesh: DeviceMesh) -> DeviceMesh | None:
    """The cp sub-mesh, or None without context parallelism."""
    return mesh["cp"] if mesh["cp"].size() > 1 else None


def flatten_dp_cp(mesh: DeviceMesh) -> None:
    """Add the flattened dims that data parallelism uses under cp: dp_shard_cp (FSDP) and dp_cp (DDP)."""
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")


def expand_kv_heads_for_cp(model: nn.Module) -> None:
    """Make attention repeat kv heads itself: the ring kernels take equal q and kv head counts.

    SDPA's enable_gqa would otherwise route fp32 attention to the math kernel, which the ring
    does not replace.
    """
    from trainctl.models.common.attention import Attention  # every family's attention subclasses it

    for module in model.modules():
        if isinstance(module, Attention):
            module.repeat_kv = True


def rope_rows(model: nn.Module, seq_len: int) -> torch.Tensor:
    """A fresh copy of the RoPE rows of one sequence: context_parallel shards it in place."""
    return model.freqs[:seq_len].clone()


@contextlib.contextmanager
def sharded_sequences(cp_mesh: DeviceMesh | None, model: nn.Module, inputs: torch.Tensor,
                      targets: torch.Tensor) -> Iterator[torch.Tensor | None]:
    """Within: inputs/targets [batch, seq] hold this rank's load-balanced slice; yields its RoPE rows.

    They are sharded in place and not restored (the step owns them). SDPA inside the context
    runs the ring, and so does SDPA's backward: torch installs the ring's handlers only while
    the context is open, so the micro-batch's backward must run inside it too. Without cp, a
    no-op that yields None (the model uses its own rows).
    """
    if cp_mesh is None:
        yield None
        return
    from torch.distributed.tensor.experimental import context_parallel

    freqs = rope_rows(model, inputs.shape[1])
    buffers = [inputs, targets, freqs]
    with context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=[1, 1, 0], no_restore_buffers=set(buffers)):
        yield freqs
