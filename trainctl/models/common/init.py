"""Initialization every family shares: values that do not depend on how a parameter is sharded or staged."""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Iterator
from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from trainctl.models.common.quantized import is_nf4, set_whole

INIT_STD = 0.02


def fill(param: torch.Tensor, init_fn: Callable[[torch.Tensor], object]) -> None:
    """Initialize `param` in place with values that do not depend on how it is sharded.

    A sharded (DTensor) parameter gets its local slice of a full-size tensor drawn from
    the (identically seeded) RNG on every rank, so FSDP/TP runs start from exactly the
    weights a single process would draw; drawing per shard would repeat one shard's
    values on every rank on CPU, and differ from the unsharded init on CUDA.
    """
    if not isinstance(param, DTensor):
        init_fn(param)
        return
    full = torch.empty(param.shape, dtype=param.dtype, device=param.to_local().device)
    init_fn(full)
    if is_nf4(param):  # QLoRA's base under FSDP2: quantized whole, then this rank's rows
        set_whole(param, full)
        return
    # src_data_rank=None: every rank holds the same full tensor, so slice locally, no communication.
    local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
    param.to_local().copy_(local)


def trunc_normal(param: torch.Tensor, std: float) -> None:
    fill(param, partial(nn.init.trunc_normal_, std=std, a=-3 * std, b=3 * std))


@contextlib.contextmanager
def rng_for(name: str, seed: int, device: torch.device) -> Iterator[None]:
    """Draw from a stream seeded by (`seed`, `name`), leaving the global RNG state as it was."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed((seed * 0x9E3779B1 + zlib.crc32(name.encode())) % 2**63)
        yield
