"""The fixed training loop. `run(cfg, run_dir)` is the worker's top level; `train_loop` the loop.

`setup` (job_setup.py) builds the whole Job (job.py); `train_loop` reads top to bottom: for each step `train_step`
(step.py: micro-batches, clip, agree, guard, optimizer step), then `after_step` (log, evaluate, commit
finished async saves, and the one `maybe_save`). The loss and its normalization: loss.py.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from trainctl.config.schema import RunConfig
from trainctl.core import rundir
from trainctl.core.measured import performance
from trainctl.models import registry
from trainctl.models.common.attention import attention_backends
from trainctl.train.checkpoint import state as checkpoint_state
from trainctl.train.checkpoint.store import checkpoint_dir, step_name
from trainctl.train.errors import WorkerConfigError, WorkerError
from trainctl.train.loop import ramp
from trainctl.train.loop.gc_schedule import collect_every
from trainctl.train.loop.hooks import Hooks
from trainctl.train.loop.job import Job
from trainctl.train.loop.job_setup import setup
from trainctl.train.loop.loss import token_loss_sum  # noqa: F401  (re-exported: tests measure the loop's own loss)
from trainctl.train.loop.step import StepResult, evaluate, train_step
from trainctl.train.loop.stop import StopRequest, requeue_slurm_job
from trainctl.train.loop.watchdog import HangWatchdog, restart_record
from trainctl.train.observe.metrics import StepTimer
from trainctl.train.parallel import distributed

log = logging.getLogger("trainctl.train")


def train_loop(job: Job) -> dict:
    """Train from the start point to `train.steps` with logging, eval and checkpoints; returns the summary.

    A stop request (signal) ends the loop early with a checkpoint; the summary says so.
    """
    begin, steps = job.progress.step, job.cfg.train.steps
    check_steps_left(job, begin, steps)
    job.watchdog.arm()  # from here on, no progress for train.hang_timeout_s is a hang (watchdog.py)
    val_loss = begin_training(job)
    job.stop.armed = True  # from here a stop signal means: finish the step, save, leave
    timer, started, stopped = StepTimer(job.world.device), time.perf_counter(), False
    empty_before = job.guard.empty_batches
    with collect_every(job.cfg.train.gc_every) as collect:
        for step in range(begin, steps):
            job.watchdog.arm()
            result = train_step(job, step)
            timer.tick()
            val_loss = after_step(job, result, timer, val_loss)
            if job.hooks.on_step_end is not None:
                job.hooks.on_step_end(job, result)
            collect(result.step)
            if result.stop:
                stopped = True
                break
    check_something_trained(job.guard.empty_batches - empty_before, steps - begin, stopped)
    if begin == steps:  # a restart after the final checkpoint (a crash or preemption before result.json)
        val_loss = evaluate_and_log(job, steps)
    job.watchdog.arm()  # the final commit gets a whole timeout of its own
    job.checkpoints.close()  # commits what is pending, then frees the pinned staging buffers
    log_commit(job)
    summary = make_summary(job, begin, stopped, val_loss, time.perf_counter() - started)
    job.metrics.final(summary)
    return summary


def check_something_trained(empty: int, ran: int, stopped: bool) -> None:
    """Every step of the run skipped for empty loss masks is a failure, not COMPLETED with loss 0.0."""
    if ran > 0 and empty == ran and not stopped:
        raise WorkerError(f"no step trained: in all {ran} steps the loss masks left no target token in the global "
                          "batch (every window holds prompt tokens only); check the dataset's masks (trainctl data "
                          "prepare --format chat|instruction counts them) or raise train.seq_len")


def check_steps_left(job: Job, begin: int, steps: int) -> None:
    """Refuse a start point past the end; begin == steps is a restart after the final checkpoint of this run."""
    if begin > steps or (begin == steps and not resumed_own_run(job)):
        raise WorkerConfigError(
            f"train.steps={steps}: the checkpoint {job.start.path} is at step {begin} already; nothing left to "
            "train (launch a new run, or resume from it with checkpoint.resume=PATH)")


def begin_training(job: Job) -> float:
    """The first eval of a fresh run (logged at step 0, unless train.eval_every=0), or the resume record."""
    if job.start.resumed:
        # drops what an earlier attempt logged past it; its console line is the resume's one line
        job.metrics.resumed(job.progress.step, str(job.start.path), job.progress.samples_seen)
        return job.progress.initial_val_loss
    job.progress.initial_val_loss = evaluate_and_log(job, 0)
    return job.progress.initial_val_loss


def after_step(job: Job, result: StepResult, timer: StepTimer, val_loss: float) -> float:
    """Log, evaluate when due, commit finished async saves, save when due; returns the latest val loss."""
    done, train, steps = result.step, job.cfg.train, job.cfg.train.steps
    job.progress.advance(done, result.loss, result.grad_norm, job.train_data.first_sample(done))
    job.metrics.step_done(done, last=done == steps or result.stop)
    if result.memory is not None:
        job.metrics.memory(done, result.memory)
    if done % job.cfg.logging.log_every == 0 or done == steps or result.stop:
        job.metrics.train(done, step_metrics(job, result, timer.lap()))
    if train.eval_every and not result.stop and (done == steps or done % train.eval_every == 0):
        val_loss = evaluate_and_log(job, done)
        timer.restart()
    job.checkpoints.poll()
    log_commit(job)
    maybe_save(job, done, result.stop)
    return val_loss


def evaluate_and_log(job: Job, step: int) -> float | None:
    """The held-out loss, logged; None (nothing logged) with evaluation off or without a val split."""
    if job.val_data is None or job.cfg.train.eval_every <= 0:
        return None
    job.watchdog.arm()  # an evaluation is progress: it gets a whole timeout of its own
    val_loss, targets = evaluate(job)
    job.metrics.eval(step, val_loss, targets, None if job.objective is None else job.objective.eval_metrics())
    return val_loss


def maybe_save(job: Job, done: int, stop: bool) -> None:
    """The one save site: on a stop, every `checkpoint.every` steps, and after the last (checkpoint.save_final)."""
    checkpoint = job.cfg.checkpoint
    if done == job.cfg.train.steps:
        due = checkpoint.save_final
    else:
        due = bool(checkpoint.every) and done % checkpoint.every == 0
    if stop or due:
        save_checkpoint(job, done)


def save_checkpoint(job: Job, step: int) -> None:
    """Checkpoint after `step` optimizer steps (see state.py for what it holds)."""
    job.watchdog.arm()  # a save is progress: a slow one is not a hang unless it alone outlasts the timeout
    state = checkpoint_state.app_state(job.model, job.optimizer)
    own = checkpoint_state.rank_state(job.optimizer)
    if hasattr(job.train_data, "state_dict"):  # a stream's position is state, not a function of the step
        own["data"] = job.train_data.state_dict()
    job.checkpoints.save(step, state, own, job.meta.state_dict())
    log_commit(job)


def log_commit(job: Job) -> None:
    """Log a save once it is committed (at once when sync; at a later poll/wait when async)."""
    stats = job.checkpoints.stats
    if stats is not None and stats != job.logged_commit:
        job.logged_commit = stats
        values = {"blocking_s": stats.blocking_s, "total_s": stats.total_s, "bytes": stats.bytes}
        job.metrics.checkpoint(stats.step, values)


def resumed_own_run(job: Job) -> bool:
    """Whether the start point is a checkpoint of this run's own (not one given by checkpoint.resume=PATH)."""
    path = job.start.path
    return path is not None and path.resolve().parent == job.checkpoints.root.resolve()


def make_summary(job: Job, begin: int, stopped: bool, val_loss: float, wall_time_s: float) -> dict:
    """result.json: where the run ended and its last numbers."""
    progress = job.progress
    return {
        "steps": progress.step,
        "stopped": stopped,
        "resumed_from_step": begin,
        "final_train_loss": progress.train_loss,
        "final_grad_norm": progress.grad_norm,
        "final_val_loss": val_loss,
        "initial_val_loss": progress.initial_val_loss,
        "wall_time_s": wall_time_s,
        "tokens_seen": ramp.tokens_seen(job, progress.step),
        **job.guard.metrics(),
    }


def step_metrics(job: Job, result: StepResult, lap: tuple[float, int]) -> dict:
    """The logged numbers of one step (loss and norm already agreed across ranks)."""
    elapsed, steps = lap
    step_time = elapsed / max(steps, 1)
    batch = ramp.batch_metrics(job, result.step, lap)  # this step's global batch and tokens (train.batch_ramp)
    tokens_per_s = batch["tokens_per_s"]
    values = {
        "loss": result.loss,
        "lr": result.lr,
        "grad_norm": result.grad_norm,
        "step_time_s": step_time,
        **batch,
        **job.scaler.metrics(),
        **job.guard.metrics(),
        **(result.extra or {}),
    }
    if job.peak_flops:
        model = job.cfg.model  # FLOPs per token: the family spec's, as the plan counts them
        flops = registry.spec(model.family).flops_per_token(model, job.cfg.train.seq_len) * tokens_per_s
        values["mfu"] = flops / (job.world.world_size * job.peak_flops)
    if job.world.device.type == "cuda":
        values["peak_mem_gib"] = torch.cuda.max_memory_allocated(job.world.device) / 2**30
        values["peak_reserved_gib"] = torch.cuda.max_memory_reserved(job.world.device) / 2**30
    return values


def report_stop(job: Job, run_dir: Path, step: int) -> None:
    """After the stop checkpoint committed: rank 0 records the stop and says how to go on; requeue on preemption."""
    cfg, stop = job.cfg, job.stop
    if not job.world.is_main:
        return
    saved = checkpoint_dir(run_dir) / step_name(step)
    if stop.signal_name:  # a stop no signal asked for (one a test requests) has nothing to record
        rundir.record_stop(run_dir, step, stop.signal_name, saved.name)
    # The early preemption warning (not a plain SIGTERM, e.g. scancel): back to the queue.
    if stop.preempted and cfg.cluster.requeues and requeue_slurm_job():
        return
    by = f" by {stop.signal_name}" if stop.signal_name else ""
    log.warning("stopped%s after step %d: checkpoint %s committed; continue with `trainctl resume %s`",
                by, step, saved.name, run_dir.name)


def run(cfg: RunConfig, run_dir: Path, stop: StopRequest | None = None, on_error=None,
        hooks: Hooks = Hooks()) -> dict:
    """The worker: join the world, train, write result.json; always closes W&B and the process group.

    stop: installed by the caller as early as it can (a signal during setup ends the worker at once).
    on_error(exc): called before the error propagates, while the process group is still up: a peer waiting
    on us fails ("connection closed") only once we close it, so what on_error records comes first.
    """
    world = distributed.init_distributed(cfg.cluster, cpu_collectives=cfg.sharding.cpu_offload)
    job = None
    watchdog = HangWatchdog.for_rank(cfg.train.hang_timeout_s, run_dir, world.rank)
    try:
        job = setup(cfg, run_dir, world, stop or StopRequest(cfg.cluster.stop_signal), hooks, watchdog)
        if hooks.on_setup is not None:
            hooks.on_setup(job)
        with attention_backends(cfg.train.attention):  # cuDNN, flash, efficient, math: set, not left to chance
            summary = train_loop(job)
        if summary["stopped"]:
            report_stop(job, run_dir, summary["steps"])
        elif world.is_main:
            summary.update(restart_record(run_dir))  # how many times torchrun restarted this launch, and why
            # predicted vs measured speed and peak (issue 26): what `trainctl tune` and a calibration compare
            record = {**summary, "performance": performance(run_dir)}
            (run_dir / rundir.RESULT).write_text(json.dumps(record, indent=2) + "\n")
        return summary
    except BaseException as exc:
        if on_error is not None:
            on_error(exc)
        raise
    finally:
        watchdog.close()  # first: nothing after this point is watched (a normal end, a stop or an error)
        if job is not None:
            job.metrics.close()
        distributed.close_distributed()
