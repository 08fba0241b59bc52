"""train.batch_ramp: the rule (core/batch_ramp.py) against a step-by-step count, the lr on the tokens clock, the
sampler's order (resumable mid-ramp), the plan's stages and total tokens, and the one-line refusals."""

from __future__ import annotations

import dataclasses
import math
from io import StringIO

import pytest
from rich.console import Console

from trainctl.config.compose import compose
from trainctl.config.errors import ConfigError
from trainctl.config.schema import DataConfig, ScheduleConfig
from trainctl.config.validate import resolve
from trainctl.core import schedules
from trainctl.core.batch_ramp import BatchRamp
from trainctl.plan.runplan import build
from trainctl.render import plan_summary, render_plan

# global 16 = micro 2 x accum 8 x dp 1; the ramp starts at 4 sequences (accum 2) and grows over 7 of 20 steps
RAMPED = ["train.steps=20", "train.global_batch=16", "train.micro_batch=2", "train.grad_accum=-1",
          "train.batch_ramp.start=4", "train.batch_ramp.steps=7", "schedule.warmup_steps=2", "train.seq_len=32"]


def ramp_of(unit: int, start: int, final: int, steps: int, total: int) -> BatchRamp:
    return BatchRamp(unit, start, final, steps, total)


def test_accumulation_grows_by_the_stated_rule_and_stages_cover_every_step():
    ramp = ramp_of(2, 2, 8, 7, 20)
    # grad_accum(s) = 2 + floor(6 s / 7) for s < 7, then 8 (written out, not computed by the module's formula)
    assert [ramp.accum_at(s) for s in range(10)] == [2, 2, 3, 4, 5, 6, 7, 8, 8, 8]
    assert [ramp.batch_at(s) for s in (0, 6, 7, 19)] == [4, 14, 16, 16]
    steps = [s.first_step + k for s in ramp.stages for k in range(s.steps)]
    assert steps == list(range(20))  # in order, no gap, no overlap
    assert all(ramp.accum_at(s.first_step + k) == s.grad_accum for s in ramp.stages for k in range(s.steps))
    assert ramp.stage_records(32)[0] == {"steps": "1-2", "global_batch": 4, "grad_accum": 2, "tokens": 2 * 4 * 32}


@pytest.mark.parametrize(("unit", "start", "final", "steps", "total"),
                         [(2, 2, 8, 7, 20), (4, 1, 16, 5, 9), (3, 1, 2, 50, 51), (1, 3, 64, 1000, 1200)])
def test_sequences_before_each_step_is_the_sum_of_the_batches(unit, start, final, steps, total):
    ramp = ramp_of(unit, start, final, steps, total)
    running = 0
    for s in range(total + 3):  # also past the last step
        assert ramp.sequences_before(s) == running, s
        running += ramp.batch_at(s)
    assert ramp.total_sequences == sum(ramp.batch_at(s) for s in range(total))
    assert sum(stage.sequences for stage in ramp.stages) == ramp.total_sequences
    # more increments than steps: some are skipped, none is repeated out of order
    accums = [ramp.accum_at(s) for s in range(total)]
    assert accums == sorted(accums) and accums[0] == start and accums[-1] == final


def test_without_a_ramp_every_figure_is_the_plain_steps():
    ramp = ramp_of(4, 3, 3, 0, 10)
    assert not ramp.enabled and len(ramp.stages) == 1
    assert [ramp.position(s) for s in range(11)] == list(range(11))  # ints: the step schedule, unchanged
    assert all(isinstance(ramp.position(s), int) for s in range(11))
    assert ramp.sequences_before(7) == 7 * 12 and ramp.total_sequences == 120


@pytest.mark.parametrize("name", schedules.names())
def test_lr_runs_on_tokens_warmup_ends_at_its_tokens_and_decay_ends_at_the_last_step(name):
    ramp, sched, lr, total = ramp_of(1, 1, 8, 20, 60), ScheduleConfig(name=name, warmup_steps=5), 1.0, 60
    length = ramp.schedule_length()
    assert length == ramp.total_sequences / 8 < total
    rates = [schedules.lr_at(ramp.position(s), lr, sched, length) for s in range(total)]
    # warmup lasts until 5 full steps' worth of sequences (40) were trained, not 5 steps: step s gets
    # lr x min(1, (sequences before s / 8 + 1) / 5), reaching lr once 4 full steps' worth were trained
    warm = [s for s in range(total) if ramp.sequences_before(s) < 5 * 8]
    assert len(warm) > 5
    for s in warm:
        assert rates[s] == pytest.approx(lr * min(1.0, (ramp.sequences_before(s) / 8 + 1) / 5), rel=1e-15)
    assert all(rates[s] < lr for s in range(total) if ramp.sequences_before(s) < 4 * 8)
    assert rates == sorted(rates) if name == "constant" else max(rates) == lr
    assert rates[0] == pytest.approx(lr / 5)  # position 0: the first warmup rate, as without a ramp
    floor = sched.min_lr_ratio * lr if name != "constant" else lr
    assert rates[-1] == pytest.approx(floor, rel=1e-12)  # the ramp ended before the last step: p(last) = T - 1
    assert ramp.position(total - 1) == length - 1


def test_without_a_ramp_the_lr_is_the_step_schedule_bit_for_bit():
    ramp, sched = ramp_of(2, 4, 4, 0, 30), ScheduleConfig(name="wsd", warmup_steps=3)
    for s in range(30):
        assert schedules.lr_at(ramp.position(s), 3e-4, sched, ramp.schedule_length()) == \
            schedules.lr_at(s, 3e-4, sched, 30)


def batches(dp_size: int, dp_rank: int, ramp: BatchRamp | None):
    from trainctl.train.loop.data import TokenBatches

    return TokenBatches(DataConfig(kind="synthetic"), "train", 8, 16, 2, 8 // dp_size, dp_rank, dp_size, 0, ramp)


def test_the_ranks_read_each_steps_global_batch_once_in_stream_order():
    ramp = ramp_of(4, 1, 4, 5, 8)  # dp 2 x micro 2: 4 sequences per accumulation step
    ranks = [batches(2, r, ramp) for r in range(2)]
    for step in range(8):
        ids = [j for data in ranks for r in data.sample_ids(step) for j in r]
        first = ramp.sequences_before(step)
        assert ids == list(range(first, first + ramp.batch_at(step)))
        assert len(ranks[0].micro_batches(step)) == ramp.accum_at(step)


def test_a_resume_inside_the_ramp_reads_what_the_uninterrupted_run_reads():
    import torch

    ramp = ramp_of(2, 1, 8, 6, 10)
    whole = batches(1, 0, ramp)
    resumed = batches(1, 0, ramp)
    resumed.resume_at(3, whole.first_sample(3))  # what TrainProgress.samples_seen holds after step 3
    for step in range(3, 10):
        assert resumed.sample_ids(step) == whole.sample_ids(step)
        for a, b in zip(resumed.micro_batches(step), whole.micro_batches(step), strict=True):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_the_plan_shows_the_stages_and_the_runs_tokens():
    cfg = resolve(compose(RAMPED))
    plan = build(cfg, with_advice=False)
    # step batches 4,4,6,8,10,12,14 then 13 steps of 16 (written out), 32 tokens each
    assert plan.batch.tokens_total == (4 + 4 + 6 + 8 + 10 + 12 + 14 + 13 * 16) * 32
    assert [s["steps"] for s in plan.batch.ramp] == ["1-2", "3", "4", "5", "6", "7", "8-20"]
    assert sum(s["tokens"] for s in plan.batch.ramp) == plan.batch.tokens_total
    out = StringIO()
    plan_summary(Console(file=out, width=200), plan.to_dict())
    render_plan(Console(file=out, width=200), plan.to_dict())
    text = out.getvalue()
    assert f"{plan.batch.tokens_total:,} tokens in all" in text and "steps 8-20: global batch 16 (8 accum)" in text
    assert "batch ramp (the lr schedule counts tokens)" in text
    plain = build(resolve(compose(RAMPED[:4] + ["train.seq_len=32"])), with_advice=False)
    assert plain.batch.ramp == [] and plain.batch.tokens_total == 20 * 16 * 32


def refusal(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as err:
        resolve(compose([*RAMPED, *overrides]))
    return err.value.problems


@pytest.mark.parametrize(("overrides", "fragment"), [
    (["train.batch_ramp.start=32"], "train.batch_ramp.start=32: must be below train.global_batch=16"),
    (["train.batch_ramp.start=16"], "train.batch_ramp.start=16: must be below train.global_batch=16"),
    (["train.batch_ramp.start=5"], "train.batch_ramp.start=5: not whole micro-batches per data-parallel rank: use a "
                                   "multiple of train.micro_batch x dp = 2 x 1 = 2"),
    (["train.batch_ramp.steps=20"], "train.batch_ramp.steps=20: the ramp must end before the run does"),
    (["train.batch_ramp.steps=0"], "train.batch_ramp.start=4: the ramp needs train.batch_ramp.steps > 0"),
    (["train.batch_ramp.start=0"], "train.batch_ramp.steps=7: no ramp without train.batch_ramp.start"),
    (["train.batch_ramp.start=-4"], "train.batch_ramp.start=-4: must be >= 0"),
    (["train.batch_ramp.steps=-1"], "train.batch_ramp.steps=-1: must be >= 0"),
    (["cluster.procs_per_node=2", "sharding.pp=2", "train.micro_batch=1", "train.batch_ramp.steps=5"],
     "train.batch_ramp.start=4: a pipeline schedule runs a fixed number of microbatches per step (sharding.pp=2)"),
    (["schedule.warmup_steps=17"], "schedule.warmup_steps=17: under the ramp the run trains 16.6 full steps' tokens"),
])
def test_nonsense_is_refused_in_one_line_naming_the_key(overrides, fragment):
    (line,) = refusal(*overrides)
    assert line.startswith(fragment) and "\n" not in line


def test_the_start_must_be_whole_micro_batches_of_every_data_parallel_rank():
    # dp 2 x micro 2: 6 sequences would be 1.5 micro-batches per rank
    (line,) = refusal("cluster.procs_per_node=2", "sharding=ddp", "train.batch_ramp.start=6")
    assert "use a multiple of train.micro_batch x dp = 2 x 2 = 4" in line
    cfg = resolve(compose([*RAMPED, "cluster.procs_per_node=2", "sharding=ddp", "train.batch_ramp.start=8"]))
    assert BatchRamp.of(cfg.train, 2).start_accum == 2 and cfg.train.grad_accum == 4


def test_a_resume_keeps_the_ramp():
    from trainctl.launch.resume import frozen

    assert frozen("train.batch_ramp.start") and frozen("train.batch_ramp.steps")


def test_the_warmup_limit_is_the_runs_length_on_the_tokens_clock():
    cfg = resolve(compose(RAMPED))
    length = BatchRamp.of(cfg.train, 1).schedule_length()
    assert math.ceil(length) - 1 == 16  # 16.625 full steps' worth: warmup 16 passes, 17 is refused above
    assert resolve(compose([*RAMPED, "schedule.warmup_steps=16"])).schedule.warmup_steps == 16
    assert dataclasses.asdict(cfg.train)["batch_ramp"] == {"start": 4, "steps": 7}


def test_resume_notes_state_the_lr_on_the_tokens_clock():
    from trainctl.plan.schedule import continuation

    sched = ScheduleConfig(name="cosine", warmup_steps=2)
    ramp = ramp_of(2, 1, 8, 10, 20)
    note, jump = continuation(15, (1.0, sched, 20), (1.0, sched, 40), (ramp, dataclasses.replace(ramp, total_steps=40)))
    want = schedules.lr_at(ramp.position(15), 1.0, sched, ramp.position(40))
    assert note.endswith(f"lr at step 16 is {want:.3g}") and want != schedules.lr_at(15, 1.0, sched, 40)
    assert jump is not None  # the re-stretched cosine is higher at step 16 than the trained step 15 was


def worker_job(ramp: BatchRamp | None, steps: int = 20):
    from types import SimpleNamespace

    from trainctl.config.schema import OptimConfig, TrainConfig

    train = TrainConfig(steps=steps, seq_len=8, global_batch=16, micro_batch=2, grad_accum=8)
    return SimpleNamespace(cfg=SimpleNamespace(train=train, optim=OptimConfig(lr=1.0),
                                               schedule=ScheduleConfig(name="cosine", warmup_steps=3)),
                           train_data=batches(1, 0, ramp))


def test_the_worker_reads_the_lr_and_the_logged_batch_off_the_sample_stream():
    from trainctl.train.loop.ramp import batch_metrics, step_lr

    ramp = ramp_of(2, 1, 8, 7, 20)
    job = worker_job(ramp)
    for s in range(20):
        assert step_lr(job, s) == schedules.lr_at(ramp.position(s), 1.0, job.cfg.schedule, ramp.schedule_length())
    record = batch_metrics(job, 3, (2.0, 2))  # logged steps 2 and 3 (batches 4 and 6: 80 tokens) in 2 s
    assert record == {"global_batch": 6, "tokens": 48, "tokens_seen": (2 + 4 + 6) * 8, "tokens_per_s": 40.0}
    # resumed after step 5 with 100 sequences seen (a checkpoint of another dp split): the clock is what was seen
    job.train_data.resume_at(5, 100)
    seen = 100 + ramp.sequences_before(9) - ramp.sequences_before(5)
    assert step_lr(job, 9) == schedules.lr_at(seen / 16, 1.0, job.cfg.schedule, job.train_data.first_sample(20) / 16)


def test_without_a_ramp_the_worker_keeps_the_step_schedule_and_its_rates_bit_for_bit():
    from trainctl.train.loop.ramp import batch_metrics, step_lr

    job = worker_job(None)
    assert [step_lr(job, s) for s in range(20)] == [schedules.lr_at(s, 1.0, job.cfg.schedule, 20) for s in range(20)]
    elapsed, steps = 0.7, 3
    record = batch_metrics(job, 9, (elapsed, steps))
    assert record["tokens_per_s"] == 16 * 8 / (elapsed / steps)  # the formula metrics.jsonl always had
    assert record["tokens_seen"] == 9 * 16 * 8 and record["global_batch"] == 16
