"""The worker's side of train.batch_ramp (the rule: core/batch_ramp.py): each step's learning rate on the
schedule's clock, and each logged step's batch and tokens.

The data (loop/data.py's TokenBatches) holds the ramp: the batch of a step and the samples before it are one
definition, read by the sampler, the lr and the metrics alike. Without a ramp every figure here equals the plain
step schedule's and global_batch x seq_len's, bit for bit.
"""

from __future__ import annotations

from trainctl.train.loop.job import Job
from trainctl.train.optim import lr_at


def step_lr(job: Job, step: int) -> float:
    """The learning rate of 0-indexed step `step`: the schedule at the tokens trained before it, in full steps."""
    ramp = job.train_data.ramp
    return lr_at(ramp.position(step), job.cfg.optim.lr, job.cfg.schedule, ramp.position(job.cfg.train.steps))


def tokens_seen(job: Job, done: int) -> int:
    """Tokens of the global batches of the first `done` steps."""
    return job.train_data.ramp.sequences_before(done) * job.cfg.train.seq_len


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
