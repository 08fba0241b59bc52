"""train.batch_ramp: a start the final batch cannot grow from, a ramp the run cannot hold, layouts it cannot run on."""

from __future__ import annotations

from hostile.common import Probe, case, refused

# tiny_cpu: global batch 16 over dp 2; micro-batch 2 makes the ramp's unit 4 sequences (grad_accum 4 at the end)
TINY = ("plan", "recipe=tiny_cpu", "train.micro_batch=2")


@case("ramp", "a start batch at or above the final one, or below 0")
def _(p: Probe) -> None:
    for start in ("32", "16"):
        refused(p.cli(*TINY, f"train.batch_ramp.start={start}", "train.batch_ramp.steps=10"),
                f"train.batch_ramp.start={start}", "below train.global_batch=16")
    refused(p.cli(*TINY, "train.batch_ramp.start=-4", "train.batch_ramp.steps=10"), "train.batch_ramp.start=-4")


@case("ramp", "a start batch that is not whole micro-batches per data-parallel rank")
def _(p: Probe) -> None:
    refused(p.cli(*TINY, "train.batch_ramp.start=6", "train.batch_ramp.steps=10"),
            "train.batch_ramp.start=6", "multiple of", "2 x 2 = 4")


@case("ramp", "a ramp as long as the run or longer, a ramp with no steps, steps with no start")
def _(p: Probe) -> None:
    for steps in ("100", "1000000"):
        refused(p.cli(*TINY, "train.batch_ramp.start=4", f"train.batch_ramp.steps={steps}"),
                f"train.batch_ramp.steps={steps}", "end before the run", "at most 99")
    refused(p.cli(*TINY, "train.batch_ramp.start=4"), "train.batch_ramp.start=4", "steps > 0")
    refused(p.cli(*TINY, "train.batch_ramp.steps=10"), "train.batch_ramp.steps=10", "no ramp without")


@case("ramp", "a ramp under a pipeline schedule, whose microbatch count is fixed")
def _(p: Probe) -> None:
    refused(p.cli(*TINY, "sharding=none", "sharding.pp=2", "train.batch_ramp.start=4", "train.batch_ramp.steps=10"),
            "train.batch_ramp.start=4", "pipeline", "sharding.pp=1")


@case("ramp", "a warmup longer than the ramped run's tokens; a ramp given a number or a fraction")
def _(p: Probe) -> None:
    refused(p.cli(*TINY, "train.steps=12", "train.batch_ramp.start=4", "train.batch_ramp.steps=11",
                  "schedule.warmup_steps=10"), "schedule.warmup_steps=10", "full steps' tokens")
    refused(p.cli(*TINY, "train.batch_ramp=3"), "train.batch_ramp")
    refused(p.cli(*TINY, "train.batch_ramp.start=4.5", "train.batch_ramp.steps=10"), "train.batch_ramp.start")
