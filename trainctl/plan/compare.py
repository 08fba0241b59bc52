"""`trainctl plan ... --compare AXIS`: the user's own model and cluster under each choice along one axis.

Axes (variants.py): sharding (none, ddp, zero1, zero2, zero3, zero3 + cpu_offload over the same
ranks), checkpointing (none, selective, op, full), tp (1, 2, 4, 8 within a node, the rest data
parallel), micro_batch (the divisors of the per-rank samples per step, accumulation derived), optim
(every optimizer of core/optimizers.py: its state bytes and step temporaries) and ep (expert parallelism over the
divisors of dp_shard: the experts FSDP2 gathers, and the all-to-all's time in the step).
A variant the config cannot take (validation or the worker refuses it) is left out.
"""

from __future__ import annotations

from trainctl.config.schema import RunConfig
from trainctl.plan.assess import assess, dims_of
from trainctl.plan.variants import AXES, along


def compare(cfg: RunConfig, axis: str) -> list[dict]:
    """One row per variant, the config itself first: the busiest rank's memory, verdict and step time."""
    if axis not in AXES:
        raise ValueError(f"unknown axis {axis!r}")
    rows, base = [], None
    for variant in along(cfg, axis):
        a = assess(variant.cfg, dims_of(variant.cfg))
        relative = a.relative_step.total_s
        base = relative if base is None else base
        step = None if a.step is None else a.step.total_s
        tokens = variant.cfg.train.tokens_per_step
        rows.append({
            "variant": variant.label,
            "overrides": list(variant.overrides),
            "states_bytes": a.memory.states,
            "optimizer_bytes": a.memory.optimizer,
            "activations_bytes": a.memory.activations,
            "peak_bytes": a.fit.peak_bytes,
            "peak_phase": a.memory.peak_phase,
            "need_bytes": a.fit.need_bytes,
            "headroom_bytes": a.fit.headroom_bytes,
            "verdict": a.fit.verdict,
            "step_time_s": step,
            "slowdown": relative / base - 1 if base else None,
            "tokens_per_s": None if not step else tokens / step,
        })
    return rows
