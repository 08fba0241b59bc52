"""Model states per rank: which parameter, gradient and optimizer tensors each data-parallel rank stores and steps.

Counted tensor by tensor from plan/shapes.py under the wrapping core.wrapping picks (FSDP2 chunks, zero1's
whole-tensor partition, LoRA's adapters). Separate from plan/memory.py's phases because tests/dist checks these
counts against the live tensors one by one, and they do not depend on activations or the step's transients.
"""

from __future__ import annotations

from trainctl.config.schema import ModelConfig, ShardingConfig
from trainctl.core import nf4, optimizers
from trainctl.core.dims import ParallelDims
from trainctl.core.lora import is_adapter, quantized_base
from trainctl.core.wrapping import Wrapping, fsdp_shards, wrapping
from trainctl.plan.activations import FP32
from trainctl.plan.shapes import (
    Tensor,
    fsdp_local_numel,
    fsdp_rows,
    stage_tensors,
    tp_local,
    zero1_assignment,
)
from trainctl.plan.stages import RankStages


def local_tensors(m: ModelConfig, stage: RankStages, tp: int) -> list[Tensor]:
    return [tp_local(t, tp, m.family) for t in stage_tensors(m, stage.layers, stage.first, stage.last)]


def stepped_tensors(tensors: list[Tensor], wrap: Wrapping, dims: ParallelDims, dp_rank: int = 0) -> list[Tensor]:
    """The (local) tensors whose optimizer states data-parallel rank `dp_rank` holds and steps.

    FSDP2: each tensor's dim-0 chunk (rank 0's are the full ones); zero1: the whole tensors of
    ZeroRedundancyOptimizer's partition; otherwise every tensor.
    """
    if wrap.fsdp:
        shards = fsdp_shards(wrap, dims)
        return [Tensor(t.name, fsdp_rows(t.rows, shards, dp_rank % shards), t.cols) for t in tensors]
    if wrap.zero1:
        return zero1_assignment(tensors, dims.dp_replicate)[dp_rank]
    return tensors


def stored_elements(
    tensors: list[Tensor], wrap: Wrapping, dims: ParallelDims, dp_rank: int = 0
) -> tuple[int, int, int]:
    """(weight/gradient elements, optimizer elements, stepped tensors) that data-parallel rank `dp_rank` stores."""
    stepped = [t.numel for t in stepped_tensors(tensors, wrap, dims, dp_rank)]
    full = sum(stepped) if wrap.fsdp else sum(t.numel for t in tensors)
    return full, sum(stepped), sum(1 for n in stepped if n > 0)


def stored_of(tensors: list[Tensor], wrap: Wrapping, dims: ParallelDims) -> int:
    """Elements of `tensors` rank 0 stores (their gradients' share)."""
    if wrap.fsdp:
        return sum(fsdp_local_numel(t, fsdp_shards(wrap, dims)) for t in tensors)
    return sum(t.numel for t in tensors)


def busiest_dp_rank(tensors: list[Tensor], wrap: Wrapping, dims: ParallelDims, optim: str = "adamw") -> int:
    """Rank 0 under FSDP2 (the first chunks are the full ones); under zero1 the rank with the most state bytes."""
    if wrap.zero1:
        shares = [optimizers.state_bytes(optim, mine) for mine in zero1_assignment(tensors, dims.dp_replicate)]
        return shares.index(max(shares))
    return 0


def model_states(
    m: ModelConfig, sharding: ShardingConfig, dims: ParallelDims, stage: RankStages, dp_rank: int,
    optim: str = "adamw",
) -> dict[str, int]:
    """Bytes of the live parameter, gradient and optimizer tensors on one rank (what memory_stats measures)."""
    tensors = local_tensors(m, stage, dims.tp)
    wrap = wrapping(sharding.strategy, dims)
    stored = stored_elements(tensors, wrap, dims, dp_rank)[0]
    optimizer = optimizers.state_bytes(optim, stepped_tensors(trainable(tensors), wrap, dims, dp_rank))
    grads = stored_of(trainable(tensors), wrap, dims)
    params = param_bytes(m, tensors, stored, wrap, dims, dp_rank)
    return {"params_bytes": params, "grads_bytes": FP32 * grads, "optimizer_bytes": optimizer}


def param_bytes(m: ModelConfig, tensors: list[Tensor], stored: int, wrap: Wrapping, dims: ParallelDims,
                dp_rank: int = 0) -> int:
    """Bytes of `stored` parameter elements: fp32, but for QLoRA's 4-bit base weights (core/nf4.py). Under FSDP2
    a rank holds its rows of each: their codes and scales, and the whole tensor's scale mean and code table."""
    held = stepped_tensors(tensors, wrap, dims, dp_rank) if wrap.fsdp else tensors
    quantized = [t.numel for t in held if quantized_base(t.name, m.lora)]
    return FP32 * (stored - sum(quantized)) + sum(nf4.tensor_bytes(n) for n in quantized)


def trainable(tensors: list[Tensor]) -> list[Tensor]:
    """The tensors that get gradients and optimizer states: LoRA's adapters when there are any, else all."""
    adapters = [t for t in tensors if is_adapter(t.name)]
    return adapters or tensors


def trainable_of(part: list[Tensor], learn: list[Tensor]) -> list[Tensor]:
    names = {t.name for t in learn}
    return [t for t in part if t.name in names]
