"""The mixtral family's parallel plan: the shared decoder's for attention; the MoE MLP is refused under tensor
parallelism (config/moe_check.py), so its plan holds no feed_forward entry; FSDP2 units are the shared decoder's."""

from __future__ import annotations

from torch import nn

from trainctl.models.common import parallel as common
from trainctl.models.common.parallel import build_stage_model, fsdp_units, root_plan

__all__ = ["block_plan", "build_stage_model", "fsdp_units", "root_plan"]


def block_plan(block: nn.Module | None = None, float8_tensorwise: bool = False) -> dict:
    plan = common.block_plan(block, float8_tensorwise)
    return {name: style for name, style in plan.items() if not name.startswith("feed_forward")}
