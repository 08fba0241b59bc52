"""The qwen3 family's parallel plan: the shared decoder's, plus the per-head q/k norms.

Under TP a rank holds n_heads/tp query heads (dim 2 of [batch, seq, heads, head_dim]); the norms see them as
a tensor sharded on the head dim (SequenceParallel with sequence_dim=2), so their replicated weights get
gradients summed over the tp ranks instead of each rank keeping the part from its own heads.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import SequenceParallel

from trainctl.models.common import parallel as common
from trainctl.models.common.parallel import build_stage_model, fsdp_units, root_plan

__all__ = ["block_plan", "build_stage_model", "fsdp_units", "root_plan"]


def block_plan(block: nn.Module | None = None, float8_tensorwise: bool = False) -> dict:
    heads = SequenceParallel(sequence_dim=2, use_local_output=True)
    return {**common.block_plan(block, float8_tensorwise), "attention.q_norm": heads, "attention.k_norm": heads}
