"""The routed experts of a mixture-of-experts block: E SwiGLU MLPs held as three stacked weights.

The contract between the MoE block (its router sorts tokens by expert) and expert parallelism
(train/parallel: the experts' weights split over ranks along their first dimension, tokens exchanged with
all-to-all around this module's forward):

    forward(x, counts) -> y
    x:      [T, dim], the tokens routed here, contiguous by expert in expert order (expert 0's first)
    counts: [E_local] integer, how many of x's rows each of this module's experts takes (sum = T)
    y:      [T, dim], each row the SwiGLU of its expert, in x's order

Weights are stored input-major ([E, in, out]) so a token block multiplies them directly:
w1, w3: [E, dim, hidden] (gate and up), w2: [E, hidden, dim] (down).

The grouped matmul (`torch._grouped_mm`, one kernel for all experts) is used where it runs: CUDA with bf16 weights,
16-byte aligned rows. Elsewhere an exact loop over the experts computes the same products one expert at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, dim: int, hidden: int):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (local_weight(w) for w in (self.w1, self.w2, self.w3))
        if grouped_mm_applies(x, w1):
            offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
            h = F.silu(torch._grouped_mm(x, w1, offs=offsets)) * torch._grouped_mm(x, w3, offs=offsets)
            return torch._grouped_mm(h, w2, offs=offsets).type_as(x)
        return expert_loop(x, counts, w1, w2, w3)


def expert_loop(x, counts, w1, w2, w3) -> torch.Tensor:
    """The reference path: each expert's rows through its own SwiGLU, in order (empty experts cost nothing)."""
    outputs = []
    for e, rows in enumerate(torch.split(x, counts.tolist(), dim=0)):
        if rows.shape[0]:
            outputs.append((F.silu(rows @ w1[e]) * (rows @ w3[e])) @ w2[e])
    if not outputs:
        return x.new_zeros(x.shape) + 0 * (w1.sum() + w2.sum() + w3.sum())
    return torch.cat(outputs, dim=0)


def grouped_mm_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """The one-kernel path: CUDA, bf16 operands (the kernel's dtype), rows 16-byte aligned."""
    if not hasattr(torch, "_grouped_mm") or not x.is_cuda or x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        return False
    return all(d * x.element_size() % 16 == 0 for d in (w.shape[1], w.shape[2]))


def local_weight(w: torch.Tensor) -> torch.Tensor:
    """The tensor this rank computes with: a plain tensor as it is; a DTensor's local part.

    Expert parallelism's experts are Shard(0) over ep (this rank's experts; their gradient is this rank's too).
    Under tensor parallelism the MoE block's weights are replicated over tp and each rank runs them on its own
    sequence-parallel tokens (models/common/parallel.py, moe_block_plan), so a replicated weight's local gradient
    is this rank's tokens' part of the sum: it is handed back Partial, and reduced over tp like the norms'
    (FSDP2 before its reduce-scatter; train/parallel/tensor_parallel.settle_partial_gradients otherwise).
    """
    if not isinstance(w, DTensor):
        return w
    grads = tuple(Partial() if placement.is_replicate() else placement for placement in w.placements)
    return w.to_local(grad_placements=grads)
