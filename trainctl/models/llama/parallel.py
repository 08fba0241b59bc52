"""The llama family's parallel plan: the shared decoder's (trainctl/models/common/parallel.py)."""

from __future__ import annotations

from trainctl.models.common.parallel import block_plan, build_stage_model, fsdp_units, root_plan

__all__ = ["block_plan", "build_stage_model", "fsdp_units", "root_plan"]
