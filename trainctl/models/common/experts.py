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

The grouped matmul (`torch._grouped_mm`, one kernel for all experts) is used where it runs: CUDA with bf16 weights
(FSDP2's compute-dtype copies, or fp32 weights cast to autocast's dtype), 16-byte aligned rows. Elsewhere an exact
loop over the experts computes the same products one expert at a time.

LoRA (core/lora.py EXPERT_TARGETS; models/lora.py attaches them): `gate_up` and `down`, when set, are ExpertAdapters
adding scale * (x @ A[e]) @ B[e] per expert to the fused gate/up product (B's first `hidden` columns the gate's,
the rest the up's, as transformers' gate_up_proj) and to the down product. Both paths apply them alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial

from trainctl.core.tensors import GROUPED_MM_ROW_BYTES

# (A [E, in, r], B [E, r, out], scale) of one expert adapter, local tensors
Adapter = tuple[torch.Tensor, torch.Tensor, float]


class ExpertAdapter(nn.Module):
    """One LoRA adapter per expert on a stacked weight, input-major as the experts' weights: lora_a [E, in, r],
    lora_b [E, r, out]; expert e adds scale * (x @ lora_a[e]) @ lora_b[e], scale = alpha / rank."""

    def __init__(self, num_experts: int, n_in: int, n_out: int, rank: int, alpha: float, device=None, dtype=None):
        super().__init__()
        self.rank, self.scale = rank, alpha / rank
        self.lora_a = nn.Parameter(torch.empty(num_experts, n_in, rank, device=device, dtype=dtype))
        self.lora_b = nn.Parameter(torch.empty(num_experts, rank, n_out, device=device, dtype=dtype))

    def local(self) -> Adapter:
        return local_weight(self.lora_a), local_weight(self.lora_b), self.scale

    def extra_repr(self) -> str:
        return f"rank={self.rank}, scale={self.scale:g}"


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, dim: int, hidden: int):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.gate_up: ExpertAdapter | None = None  # LoRA's, when model.lora targets the experts (models/lora.py)
        self.down: ExpertAdapter | None = None

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (local_weight(w) for w in (self.w1, self.w2, self.w3))
        gate_up, down = (None if a is None else a.local() for a in (self.gate_up, self.down))
        if (dtype := autocast_dtype(x)) is not None:
            x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
            gate_up, down = (None if a is None else (a[0].to(dtype), a[1].to(dtype), a[2]) for a in (gate_up, down))
        adapters = [t for a in (gate_up, down) if a is not None for t in a[:2]]
        if grouped_mm_applies(x, w1, *adapters):
            return grouped_path(x, counts, w1, w2, w3, gate_up, down).type_as(x)
        return expert_loop(x, counts, w1, w2, w3, gate_up, down)


def grouped_path(x, counts, w1, w2, w3, gate_up: Adapter | None, down: Adapter | None) -> torch.Tensor:
    """The one-kernel path: every expert's rows at once, per matmul (the adapters' two products too)."""
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)

    def mm(rows, w):
        return torch._grouped_mm(rows, w, offs=offsets)

    gate, up = mm(x, w1), mm(x, w3)
    if gate_up is not None:
        a, b, scale = gate_up
        extra_gate, extra_up = (scale * mm(mm(x, a), b)).chunk(2, dim=-1)
        gate, up = gate + extra_gate, up + extra_up
    h = F.silu(gate) * up
    out = mm(h, w2)
    if down is not None:
        a, b, scale = down
        out = out + scale * mm(mm(h, a), b)
    return out


def expert_loop(x, counts, w1, w2, w3, gate_up: Adapter | None = None, down: Adapter | None = None) -> torch.Tensor:
    """The reference path: each expert's rows through its own SwiGLU (and adapters), in order (empty experts cost
    nothing)."""
    outputs = []
    for e, rows in enumerate(torch.split(x, counts.tolist(), dim=0)):
        if rows.shape[0]:
            gate, up = rows @ w1[e], rows @ w3[e]
            if gate_up is not None:
                a, b, scale = gate_up
                extra_gate, extra_up = (scale * ((rows @ a[e]) @ b[e])).chunk(2, dim=-1)
                gate, up = gate + extra_gate, up + extra_up
            h = F.silu(gate) * up
            out = h @ w2[e]
            if down is not None:
                a, b, scale = down
                out = out + scale * ((h @ a[e]) @ b[e])
            outputs.append(out)
    if not outputs:  # no rows: every weight still gets its (zero) gradient, as the data-parallel peers' do
        weights = [w1, w2, w3] + [t for adapter in (gate_up, down) if adapter is not None for t in adapter[:2]]
        return x.new_zeros(x.shape) + 0 * sum(w.sum() for w in weights)
    return torch.cat(outputs, dim=0)


def grouped_mm_applies(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """The one-kernel path: CUDA, bf16 operands (the kernel's dtype), every weight's rows 16-byte aligned."""
    if not hasattr(torch, "_grouped_mm") or not x.is_cuda or x.dtype != torch.bfloat16:
        return False
    aligned = [d * x.element_size() % GROUPED_MM_ROW_BYTES == 0 for w in weights for d in (w.shape[1], w.shape[2])]
    return all(w.dtype == torch.bfloat16 for w in weights) and all(aligned)


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would run this module's matmuls in, None outside autocast. Autocast casts each matmul's
    operands itself, the loop's as anyone's; the grouped kernel needs them cast beforehand (fp32 master weights under
    DDP or one process with precision=bf16 would otherwise keep the experts on the loop, the slow path). The cast
    values are those autocast would compute with, so both paths give what they gave under autocast."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


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
