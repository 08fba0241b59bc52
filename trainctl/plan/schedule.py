"""What the plan says of the learning-rate schedule (core/schedules.py's lr_at, which the worker steps by).

Torch-free on purpose: `trainctl resume NAME train.steps=N` tells, before anything starts, what the
schedule does at the step the run continues from (a cosine re-stretched, a WSD decay begun anew).
"""

from __future__ import annotations

from trainctl.config.schema import ScheduleConfig
from trainctl.core import schedules
from trainctl.core.batch_ramp import BatchRamp
from trainctl.core.schedules import decay_start, lr_at

# A step-to-step change of the rate beyond this share is a jump, not the schedule's own slope.
JUMP_RATIO = 0.05


def continuation(step: int, before: tuple[float, ScheduleConfig, int], after: tuple[float, ScheduleConfig, int],
                 ramps: tuple[BatchRamp | None, BatchRamp | None] = (None, None)) -> tuple[str, str | None]:
    """What the schedule does when a run continues at `step` (steps done) under new settings.

    `before` and `after`: (optim.lr, schedule, train.steps) as trained and as continued. Returns a one-line
    note (what the schedule now does) and a warning when the rate of the next step differs from the last
    trained step's by more than JUMP_RATIO (None otherwise). `ramps`: train.batch_ramp as trained and as continued,
    whose schedule runs on tokens (core/batch_ramp.py).
    """
    lr0, s0, n0 = before
    lr1, s1, n1 = after
    last = _lr(step - 1, lr0, s0, n0, ramps[0]) if step > 0 else None
    nxt = _lr(step, lr1, s1, n1, ramps[1])
    note = f"schedule: {_describe(lr1, s1, n1, step, n0)}; lr at step {step + 1} is {nxt:.3g}"
    if last is None or abs(nxt - last) <= JUMP_RATIO * max(abs(last), abs(nxt)):
        return note, None
    why = _jump_cause(s0, s1, n0, n1, step, lr0, lr1)
    return note, (f"the learning rate jumps from {last:.3g} (step {step}, as trained) to {nxt:.3g} (step {step + 1})"
                  f"{why}")


def _lr(step: int, lr: float, s: ScheduleConfig, steps: int, ramp: BatchRamp | None) -> float:
    if ramp is None or not ramp.enabled:
        return lr_at(step, lr, s, steps)
    return lr_at(ramp.position(step), lr, s, ramp.position(steps))


def _describe(lr: float, s: ScheduleConfig, steps: int, step: int, old_steps: int) -> str:
    floor = s.min_lr_ratio * lr
    kind = schedules.spec(s.name)
    if kind.decay is None:
        return f"{s.name} at {lr:.3g}"
    if kind.stretches:
        stretched = f", re-stretched from {old_steps} to {steps} steps" if steps != old_steps else ""
        return f"{s.name} decay from {lr:.3g} to {floor:.3g} at step {steps}{stretched}"
    start = decay_start(s, steps)
    continued = f" (the stable phase continues past step {old_steps})" if steps > old_steps else ""
    return f"{s.name}: stable at {lr:.3g} until step {start + 1}, then decays to {floor:.3g} by step {steps}{continued}"


def _jump_cause(s0: ScheduleConfig, s1: ScheduleConfig, n0: int, n1: int, step: int, lr0: float, lr1: float) -> str:
    if lr0 != lr1 or s0 != s1:
        return ": optim.lr or schedule.* changed"
    kind = schedules.spec(s1.name)
    if kind.decay is not None and not kind.stretches and step - 1 > decay_start(s0, n0):
        return (f": the run had begun its {s1.name} decay at step {decay_start(s0, n0) + 2}; a checkpoint from before "
                "it continues the stable phase without a jump (a new run with checkpoint.resume=PATH)")
    if n1 != n0:
        return f": the {s1.name} decay is re-stretched from {n0} to {n1} steps"
    return ""
