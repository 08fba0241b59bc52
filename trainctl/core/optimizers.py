"""The optimizers `optim.name` chooses from, as the plan and validation see them (torch-free).

Each spec states what its optimizer keeps per parameter tensor, so the plan counts the live state
tensors the worker's optimizer holds (tests/dist/test_plan_memory.py compares them), which keys of
`optim` it reads, and whether it runs on DTensor parameters (FSDP2 shards, tensor parallelism).
The worker's builder for each name is in trainctl/train/optim.py (OPTIMIZER_BUILDERS); the names here
are the field's choices (config/schema.py), one source.

State is fp32 (master weights are fp32 whatever the compute dtype):
    adamw      exp_avg + exp_avg_sq: 2 x 4 bytes per element, + a float32 step scalar per tensor
    adafactor  a matrix keeps its row and column second-moment factors (rows + cols elements, not rows x cols),
               a vector its full second moment; no first moment; + a float32 step scalar per tensor
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from trainctl.core.tensors import Tensor
from trainctl.core.wrapping import Wrapping

FP32 = 4
STEP_BYTES = 4  # the per-tensor step counter both optimizers keep (a float32 scalar tensor)


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    summary: str  # what its state is, for the plan's notes
    reads: tuple[str, ...]  # the optim keys it uses besides name and grad_clip (the loop's)
    state_bytes: Callable[[Tensor], int]  # bytes of its state for one (local) parameter tensor
    step_temp_bytes: Callable[[Sequence[Tensor], bool], int]  # temporaries of one step (tensors, fused on CUDA)
    on_dtensor: bool  # whether it steps DTensor parameters (FSDP2 shards, tensor parallelism)


def _adamw_state(t: Tensor) -> int:
    return 2 * FP32 * t.numel + STEP_BYTES if t.numel else 0  # an empty FSDP2 shard gets no state


def _adamw_temp(tensors: Sequence[Tensor], fused: bool) -> int:
    """Fused AdamW (CUDA) allocates nothing; the foreach one allocates one fp32 temporary per element."""
    return 0 if fused else FP32 * sum(t.numel for t in tensors)


def _adafactor_state(t: Tensor) -> int:
    if not t.numel:
        return 0
    factors = t.rows + t.cols if t.cols > 1 else t.numel  # torch.optim.Adafactor: row_var, col_var / variance
    return FP32 * factors + STEP_BYTES


def _adafactor_temp(tensors: Sequence[Tensor], fused: bool) -> int:
    """foreach on CUDA (torch's default there): a variance estimate and an update per element, for all at once;
    the for-loop elsewhere: the same two for the largest tensor only."""
    sizes = [t.numel for t in tensors] or [0]
    return 2 * FP32 * (sum(sizes) if fused else max(sizes))


OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adamw": OptimizerSpec("adamw", "AdamW states (2 x fp32 + step)", ("lr", "beta1", "beta2", "eps", "weight_decay"),
                           _adamw_state, _adamw_temp, on_dtensor=True),
    # Adafactor's step takes norms over a matrix's last two dims in place, which DTensor refuses on a shard
    # (aten.pow_ on a partial norm, torch 2.13): plain tensors only (none, ddp, zero1 without tp or pp).
    "adafactor": OptimizerSpec("adafactor", "Adafactor factored second moments (rows + cols per matrix, fp32)",
                               ("lr", "weight_decay", "beta2_decay"), _adafactor_state, _adafactor_temp,
                               on_dtensor=False),
}


def names() -> tuple[str, ...]:
    return tuple(OPTIMIZERS)


def spec(name: str) -> OptimizerSpec:
    return OPTIMIZERS[name]


def state_bytes(name: str, tensors: Sequence[Tensor]) -> int:
    """Bytes of the optimizer state for these (local) tensors."""
    per_tensor = OPTIMIZERS[name].state_bytes
    return sum(per_tensor(t) for t in tensors)


def unsupported(name: str, wrap: Wrapping, tp: int) -> list[str]:
    """One line when the optimizer cannot step the parameters this wrapping gives it (DTensors)."""
    if name not in OPTIMIZERS or OPTIMIZERS[name].on_dtensor or not (wrap.fully_shard or tp > 1):
        return []
    plain = [n for n, s in OPTIMIZERS.items() if s.on_dtensor]
    layout = f"sharding.tp={tp}" if tp > 1 else "FSDP2 (sharding=zero2, zero3, fsdp, hsdp, or ddp with pp)"
    return [f"optim.name={name}: it cannot step the sharded (DTensor) parameters of {layout}; use sharding=none, "
            f"ddp or zero1 without tp (ddp and zero1 without pp), or optim.name={plain[0]}"]
