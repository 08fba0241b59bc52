"""The qwen3_moe family's parallel plan: qwen3's for attention; the MoE MLP is refused under tensor parallelism
(config/moe_check.py), so its plan holds no feed_forward entry; FSDP2 units are the shared decoder's (one per
block: a block's experts are gathered and freed with it)."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import SequenceParallel

from trainctl.models.common import parallel as common
from trainctl.models.common.parallel import build_stage_model, fsdp_units, root_plan

__all__ = ["block_plan", "build_stage_model", "fsdp_units", "root_plan"]


def block_plan(block: nn.Module | None = None, float8_tensorwise: bool = False) -> dict:
    heads = SequenceParallel(sequence_dim=2, use_local_output=True)  # as qwen3's per-head q/k norms
    plan = {**common.block_plan(block, float8_tensorwise), "attention.q_norm": heads, "attention.k_norm": heads}
    return {name: style for name, style in plan.items() if not name.startswith("feed_forward")}
