"""The batch-size ramp (`train.batch_ramp`): how many sequences each optimizer step trains on (torch-free).

The rule, in whole micro-batches per data-parallel rank (unit = train.micro_batch x dp sequences):
    a0 = batch_ramp.start / unit          grad_accum of step 0
    A  = train.grad_accum                 grad_accum once the ramp is over (global_batch = A x unit)
    R  = batch_ramp.steps                 the ramp's length in optimizer steps
    grad_accum(s) = a0 + floor((A - a0) * s / R)  for 0-indexed step s < R, and A from step R on.
So the accumulation grows by one micro-batch per rank every R / (A - a0) steps (an increment with no step of its
own is skipped when R < A - a0); the micro-batch, the memory per micro-batch and the data-parallel split never
change. `start=0` is no ramp: every step trains on train.global_batch.

The learning-rate schedule's clock under a ramp is tokens, not steps: step s sits at position
p(s) = (sequences trained before s) / train.global_batch, the tokens seen in units of one full step, and
core/schedules.lr_at reads warmup_steps and the decay in those units. A ramp's small steps then advance
warmup and decay by the data they carry: warmup spans warmup_steps x global_batch sequences whatever the ramp,
and the decay reaches its floor on the last step (the ramp ends before the last step, so p(last) = T - 1 with
T = the run's sequences / global_batch). Without a ramp p(s) = s: the schedule is the step schedule, unchanged.

`train` arguments are a config.schema.TrainConfig (not imported: core sits below config).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class Stage:
    """Consecutive steps of one batch size."""

    first_step: int  # 0-indexed optimizer step
    steps: int
    grad_accum: int
    global_batch: int  # sequences per step

    @property
    def sequences(self) -> int:
        return self.steps * self.global_batch


@dataclass(frozen=True)
class BatchRamp:
    """The per-step batch of a run: `start_accum` micro-batches per rank growing to `final_accum` over `steps`."""

    unit: int  # sequences one more micro-batch per rank adds to the global batch: micro_batch x dp
    start_accum: int
    final_accum: int
    steps: int  # ramp length R; 0: no ramp (start_accum == final_accum)
    total_steps: int  # train.steps

    @classmethod
    def of(cls, train, dp: int | None = None) -> BatchRamp:
        """The ramp of a resolved TrainConfig (validate checked it: problems() is empty); dp: from its batch math."""
        dp = dp or train.global_batch // (train.micro_batch * train.grad_accum)
        unit = train.micro_batch * dp
        ramp = train.batch_ramp
        start = ramp.start // unit if ramp.start > 0 else train.grad_accum
        return cls(unit, start, train.grad_accum, ramp.steps if ramp.start > 0 else 0, train.steps)

    @property
    def enabled(self) -> bool:
        return self.steps > 0 and self.start_accum < self.final_accum

    def accum_at(self, step: int) -> int:
        """grad_accum of 0-indexed step `step` (the module's rule)."""
        if step >= self.steps:
            return self.final_accum
        return self.start_accum + (self.final_accum - self.start_accum) * step // self.steps

    def batch_at(self, step: int) -> int:
        """Sequences in step `step`'s global batch."""
        return self.accum_at(step) * self.unit

    @cached_property
    def stages(self) -> tuple[Stage, ...]:
        """The run's steps grouped by batch size, in order; the last stage is the full batch to train.steps."""
        if not self.enabled:
            return (Stage(0, self.total_steps, self.final_accum, self.final_accum * self.unit),)
        grow = self.final_accum - self.start_accum
        # accum a0 + k starts at the first step s with grow * s // R >= k, i.e. s = ceil(k * R / grow)
        firsts = [-(-k * self.steps // grow) for k in range(grow)] + [self.steps]
        out = [Stage(first, nxt - first, self.start_accum + k, (self.start_accum + k) * self.unit)
               for k, (first, nxt) in enumerate(zip(firsts, firsts[1:], strict=False)) if nxt > first]
        return (*out, Stage(self.steps, self.total_steps - self.steps, self.final_accum, self.final_accum * self.unit))

    @cached_property
    def _firsts(self) -> list[int]:
        return [stage.first_step for stage in self.stages]

    @cached_property
    def _before(self) -> list[int]:
        """Sequences trained before each stage's first step."""
        sums, total = [], 0
        for stage in self.stages:
            sums.append(total)
            total += stage.sequences
        return sums

    def sequences_before(self, step: int) -> int:
        """Sequences of the global batches of steps 0 .. step-1 (any step >= 0, also past train.steps)."""
        if not self.enabled:
            return step * self.final_accum * self.unit
        i = bisect.bisect_right(self._firsts, step) - 1
        stage = self.stages[i]
        return self._before[i] + (step - stage.first_step) * stage.global_batch

    @property
    def total_sequences(self) -> int:
        return self.sequences_before(self.total_steps)

    def position(self, step: int) -> float | int:
        """The lr schedule's clock at step `step`: sequences before it / the full global batch (the module doc)."""
        if not self.enabled:
            return step
        return self.sequences_before(step) / (self.final_accum * self.unit)

    def schedule_length(self) -> float | int:
        """The run's length on that clock: train.steps without a ramp, fewer full steps' worth with one."""
        return self.position(self.total_steps)

    def stage_records(self, seq_len: int) -> list[dict]:
        """The plan's view of the stages: 1-based steps as logged, the batch, and the tokens each covers."""
        return [{"steps": _steps_label(s), "global_batch": s.global_batch, "grad_accum": s.grad_accum,
                 "tokens": s.sequences * seq_len} for s in self.stages]

    def describe(self, seq_len: int) -> str:
        """One line: from what batch to what, over how many steps, and what the run trains in all."""
        first, full = self.start_accum * self.unit, self.final_accum * self.unit
        return (f"batch ramp: global batch {first} -> {full} sequences over steps 1-{self.steps} (grad_accum "
                f"{self.start_accum} -> {self.final_accum}, {len(self.stages) - 1} ramp stages), then {full} to step "
                f"{self.total_steps}; {self.total_sequences * seq_len:,} tokens in all; the lr schedule counts "
                f"tokens ({self.schedule_length():.1f} full steps' worth)")


def _steps_label(stage: Stage) -> str:
    first, last = stage.first_step + 1, stage.first_step + stage.steps
    return str(first) if first == last else f"{first}-{last}"


def problems(train, dp: int, pp: int, warmup_steps: int) -> list[str]:
    """One line per nonsense in train.batch_ramp, against the resolved batch math (`train` resolved)."""
    ramp = train.batch_ramp
    if ramp.start == 0 and ramp.steps == 0:
        return []
    key = f"train.batch_ramp.start={ramp.start}"
    unit, final = train.micro_batch * dp, train.global_batch
    if ramp.start < 0 or ramp.steps < 0 or unit < 1 or final < 1:
        return []  # the declared ranges (and the batch math) name these
    if ramp.start == 0:
        return [f"train.batch_ramp.steps={ramp.steps}: no ramp without train.batch_ramp.start (sequences of the "
                "first step); set start, or steps=0"]
    if ramp.steps == 0:
        return [f"{key}: the ramp needs train.batch_ramp.steps > 0 (the steps over which it grows to "
                f"train.global_batch={final})"]
    found = []
    if ramp.start >= final:
        found.append(f"{key}: must be below train.global_batch={final} (the batch the ramp grows to); "
                     "use a smaller start, or start=0 for no ramp")
    elif ramp.start % unit:
        found.append(f"{key}: not whole micro-batches per data-parallel rank: use a multiple of train.micro_batch x "
                     f"dp = {train.micro_batch} x {dp} = {unit} (e.g. {max(unit, ramp.start // unit * unit)})")
    if ramp.steps >= train.steps:
        found.append(f"train.batch_ramp.steps={ramp.steps}: the ramp must end before the run does "
                     f"(train.steps={train.steps}); use at most {train.steps - 1}")
    if pp > 1:
        found.append(f"{key}: a pipeline schedule runs a fixed number of microbatches per step (sharding.pp={pp}); "
                     "drop the ramp (start=0) or use sharding.pp=1")
    if not found:
        length = BatchRamp.of(train, dp).schedule_length()
        if warmup_steps >= length:
            found.append(f"schedule.warmup_steps={warmup_steps}: under the ramp the run trains {length:.1f} full "
                         f"steps' tokens (the schedule's clock); use at most {math.ceil(length) - 1}")
    return found
