"""The mixtral family's parallel plan: the shared decoder's for attention; under tensor parallelism the MoE MLP is
replicated over tp and runs on each rank's sequence-parallel tokens (common.parallel.moe_block_plan); FSDP2 units
are the shared decoder's (one per block: a block's experts are gathered and freed with it)."""

from __future__ import annotations

from trainctl.models.common.parallel import build_stage_model, fsdp_units, root_plan
from trainctl.models.common.parallel import moe_block_plan as block_plan

__all__ = ["block_plan", "build_stage_model", "fsdp_units", "root_plan"]
