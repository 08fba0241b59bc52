"""The qwen3_moe family's parallel plan: qwen3's for attention (its per-head q/k norms); under tensor parallelism
the MoE MLP is replicated over tp and runs on each rank's sequence-parallel tokens (common.parallel.moe_block_plan);
FSDP2 units are the shared decoder's (one per block: a block's experts are gathered and freed with it)."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import SequenceParallel

from trainctl.models.common.parallel import build_stage_model, fsdp_units, moe_block_plan, root_plan

__all__ = ["block_plan", "build_stage_model", "fsdp_units", "root_plan"]


def block_plan(block: nn.Module | None = None, float8_tensorwise: bool = False) -> dict:
    heads = SequenceParallel(sequence_dim=2, use_local_output=True)  # as qwen3's per-head q/k norms
    return {**moe_block_plan(block, float8_tensorwise), "attention.q_norm": heads, "attention.k_norm": heads}
