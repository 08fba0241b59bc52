"""The worker's side of train.batch_ramp (the rule: core/batch_ramp.py): each step's learning rate on the
schedule's clock, and each logged step's batch and tokens.

The data (loop/data.py's TokenBatches) holds the ramp: the batch of a step and the samples before it are one
definition, read by the sampler, the lr and the metrics alike. Without a ramp every figure here equals the plain
step schedule's and global_batch x seq_len's, bit for bit.
"""

from __future__ import annotations

from trainctl.config.schema import RunConfig
from trainctl.core import batch_ramp
from trainctl.core.batch_ramp import BatchRamp
from trainctl.train.errors import WorkerConfigError
from trainctl.train.loop.job import Job
from trainctl.train.optim import lr_at


def train_ramp(cfg: RunConfig, dp: int) -> BatchRamp:
    """The run's ramp on this data-parallel degree; a hand-edited config.yaml meets the launcher's refusals here."""
    problems = batch_ramp.problems(cfg.train, dp, cfg.sharding.pp, cfg.schedule.warmup_steps)
    if problems:
        raise WorkerConfigError("; ".join(problems))
    return BatchRamp.of(cfg.train, dp)


def step_lr(job: Job, step: int) -> float:
    """The learning rate of 0-indexed step `step`: the schedule at the tokens trained before it, in full steps.

    The clock is the sample stream's own position (the checkpoint's samples seen, then this run's batches), so a
    ramped run resumed on another data-parallel split, whose later ramp steps round to other whole micro-batches,
    still reads the schedule at the tokens it really trained. Without a ramp: the step itself, as always.
    """
    data, train = job.train_data, job.cfg.train
    if not data.ramp.enabled:
        return lr_at(step, job.cfg.optim.lr, job.cfg.schedule, train.steps)
    position, length = data.first_sample(step) / train.global_batch, data.first_sample(train.steps) / train.global_batch
    return lr_at(position, job.cfg.optim.lr, job.cfg.schedule, length)


def tokens_seen(job: Job, done: int) -> int:
    """Tokens of the global batches of the first `done` steps (a resume's checkpoint counts what it had seen)."""
    return job.train_data.first_sample(done) * job.cfg.train.seq_len


def batch_metrics(job: Job, done: int, lap: tuple[float, int]) -> dict:
    """The logged step's global batch and tokens, the tokens seen so far, and the lap's tokens per second
    (`lap`: seconds and steps since the last log; under a ramp its steps carry different batches)."""
    ramp, seq_len = job.train_data.ramp, job.cfg.train.seq_len
    elapsed, steps = lap
    steps = max(steps, 1)
    lap_tokens = (ramp.sequences_before(done) - ramp.sequences_before(max(done - steps, 0))) * seq_len
    batch = ramp.batch_at(done - 1)
    return {"global_batch": batch, "tokens": batch * seq_len, "tokens_seen": tokens_seen(job, done),
            "tokens_per_s": lap_tokens / steps / (elapsed / steps)}
