"""The learning-rate schedules `schedule.name` chooses from: one spec each (torch-free).

After linear warmup, a schedule holds the peak rate until `decay_start` and then multiplies the
distance to the floor by `decay(progress)`, progress going from 0 (right after decay_start) to 1 (the
last step). `lr_at` below is the one lr function built on these: the worker steps by it and the plan
(trainctl/plan/schedule.py) describes it; the names here are the field's choices (config/schema.py), one source.

`schedule` arguments are a config.schema.ScheduleConfig (not imported: core sits below config).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ScheduleSpec:
    name: str
    decay: Callable[[float], float] | None  # multiplier from 1 (progress 0) to 0 (progress 1); None: no decay
    # The last step at the peak rate: (warmup_steps, decay_fraction, total_steps) -> step
    decay_start: Callable[[int, float, int], int]
    describe: str  # what it does after warmup, for the docs and the plan

    @property
    def stretches(self) -> bool:
        """Its decay spans every step after warmup, so a new train.steps re-stretches it (wsd's is a fixed tail)."""
        return self.decay is not None and self.decay_start is _after_warmup


def _after_warmup(warmup: int, decay_fraction: float, total: int) -> int:
    return warmup


def _wsd_start(warmup: int, decay_fraction: float, total: int) -> int:
    """Warmup, stable at the peak, then the decay over the last decay_fraction of the steps."""
    decay_steps = max(1, round(decay_fraction * total))
    return max(warmup, total - 1 - decay_steps)


def _linear(progress: float) -> float:
    return 1.0 - progress


def _cosine(progress: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * progress))


SCHEDULES: dict[str, ScheduleSpec] = {
    "constant": ScheduleSpec("constant", None, _after_warmup, "stays at optim.lr"),
    "linear": ScheduleSpec("linear", _linear, _after_warmup, "decays linearly to the floor at the last step"),
    "cosine": ScheduleSpec("cosine", _cosine, _after_warmup, "decays along a half cosine to the floor at the end"),
    "wsd": ScheduleSpec("wsd", _linear, _wsd_start,
                        "holds optim.lr, then decays linearly to the floor over the last decay_fraction of the steps"),
}


def names() -> tuple[str, ...]:
    return tuple(SCHEDULES)


def spec(name: str) -> ScheduleSpec:
    return SCHEDULES[name]


def decay_start(schedule, total_steps: int) -> int:
    """The last step at the peak rate before the decay (warmup's end; for wsd, where its decay begins)."""
    return spec(schedule.name).decay_start(schedule.warmup_steps, schedule.decay_fraction, total_steps)


def lr_at(step: int | float, lr: float, schedule, total_steps: int | float) -> float:
    """Learning rate for 0-indexed optimizer step `step` of `total_steps`.

    Under train.batch_ramp both are positions on the tokens clock (floats, in full steps' worth of tokens:
    core/batch_ramp.py); the formulas below read them alike.

    Linear warmup: step w (< warmup_steps) gets lr * (w + 1) / warmup_steps, so it starts
    near zero and the last warmup step reaches lr. Then the schedule `schedule.name` picks:
    `constant` stays at lr; `linear` and `cosine` decay from lr right after warmup to
    min_lr_ratio * lr at the last step; `wsd` holds lr and decays linearly to the floor over
    the last decay_fraction of steps.
    """
    warmup = schedule.warmup_steps
    if step < warmup:
        # min: a ramp's fractional position may pass warmup within one step (for whole steps it is step + 1)
        return lr * min(step + 1, warmup) / warmup
    if schedule.name not in SCHEDULES:
        raise ValueError(f"schedule.name={schedule.name!r}: unknown schedule; use {', '.join(names())}")
    decay = spec(schedule.name).decay
    if decay is None:
        return lr
    floor = schedule.min_lr_ratio * lr
    start, last = decay_start(schedule, total_steps), total_steps - 1
    if step <= start:
        return lr
    progress = min(1.0, (step - start) / max(1, last - start))
    return floor + (lr - floor) * decay(progress)
