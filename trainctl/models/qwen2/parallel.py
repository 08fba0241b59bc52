"""The qwen2 family's parallel plan: llama's (ColwiseParallel splits the q, k, v biases with their rows)."""

from __future__ import annotations

from trainctl.models.llama.parallel import block_plan, build_stage_model, fsdp_units, root_plan

__all__ = ["block_plan", "build_stage_model", "fsdp_units", "root_plan"]
