"""train.batch_ramp's typed keys (the rule and the learning-rate clock: trainctl/core/batch_ramp.py). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from trainctl.config.fields import at_least


@dataclass(frozen=True)
class BatchRampConfig:
    """Grow the global batch from `start` to train.global_batch over the first `steps` optimizer steps.

    grad_accum(s) = a0 + floor((A - a0) x s / steps) for step s < steps (0-indexed), A after; a0 = start /
    (micro_batch x dp), A = train.grad_accum. The learning-rate schedule then counts tokens, in full steps' worth.
    """

    # sequences of step 0's global batch: whole micro-batches per data-parallel rank, below global_batch; 0: no ramp
    start: int = at_least(0, 0, "0 means no ramp")
    # ramp length R < train.steps: 0-based step s < R accumulates a0 + floor((A - a0) x s / R) micro-batches per rank
    # (a0 = start / (micro_batch x dp), A = train.grad_accum), A from step R on; the lr schedule then counts tokens,
    # step s at (sequences before s) / global_batch full steps (docs/plan.md)
    steps: int = at_least(0, 0, "0 means no ramp")
