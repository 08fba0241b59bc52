"""The fixed training loop. `run(cfg, run_dir)` is the worker's top level; `train_loop` the loop.

`setup` builds the whole Job (job.py); `train_loop` reads top to bottom: for each step `train_step`
(step.py: micro-batches, clip, agree, guard, optimizer step), then `after_step` (log, evaluate, commit
finished async saves, and the one `maybe_save`). The loss and its normalization: loss.py.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from trainctl.config.schema import RunConfig
from trainctl.core import model_record, rundir
from trainctl.core.dims import ParallelDims
from trainctl.core.gpus import MFU_FORMULA
from trainctl.core.lora import adapter_count
from trainctl.core.measured import performance
from trainctl.core.support import lora_unsupported
from trainctl.core.wrapping import wrapping_of
from trainctl.models import registry
from trainctl.models.build import build_model
from trainctl.models.common.attention import attention_backends
from trainctl.train.checkpoint import state as checkpoint_state
from trainctl.train.checkpoint.resume import StartPoint, find_source, restore
from trainctl.train.checkpoint.state import CheckpointMeta, TrainProgress
from trainctl.train.checkpoint.store import CheckpointManager, checkpoint_dir, step_name
from trainctl.train.errors import WorkerConfigError, WorkerError
from trainctl.train.loop import qlora_start, ramp
from trainctl.train.loop.data import TokenBatches
from trainctl.train.loop.data_setup import check_vocab, prepare_data
from trainctl.train.loop.gc_schedule import collect_every
from trainctl.train.loop.guards import StepGuard
from trainctl.train.loop.hooks import Hooks
from trainctl.train.loop.job import Job
from trainctl.train.loop.loss import (
    token_loss_sum,  # noqa: F401  (re-exported: tests measure the loop's own loss)
    use_planned_chunks,
)
from trainctl.train.loop.loss_scaling import build_loss_scaler
from trainctl.train.loop.micro_batch import MicroBatchContext
from trainctl.train.loop.sources import DataError
from trainctl.train.loop.step import StepResult, evaluate, train_step
from trainctl.train.loop.stop import StopRequest, requeue_slurm_job
from trainctl.train.loop.watchdog import HangWatchdog, restart_record
from trainctl.train.observe.metrics import MetricsLogger, StepTimer, device_peak_flops, print0
from trainctl.train.optim import build_optimizer, zero1_group
from trainctl.train.parallel import distributed
from trainctl.train.parallel.context_parallel import check_cp_device, cp_mesh_of
from trainctl.train.parallel.float8 import register_float8_scale_precompute
from trainctl.train.parallel.parallelize import check_supported, parallelize
from trainctl.train.parallel.pipeline import Pipeline, build_pipeline
from trainctl.train.preference.setup import batches_for, build_objective

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
    job.metrics.eval(step, val_loss, targets)
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
    job.checkpoints.save(step, state, checkpoint_state.rank_state(job.optimizer), job.meta.state_dict())
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


def build_data(cfg: RunConfig, mesh, world: distributed.World) -> tuple[TokenBatches, TokenBatches | None]:
    """Train and val batches for this rank's data-parallel coordinates; rank 0 builds caches first.

    Val is None when the data has no usable val split and `train.eval_every=0` asked for no evaluation
    (the plan refuses such data when evaluation is on): the run trains without evaluating.
    """
    if world.is_main:
        prepare_data(cfg.data)
        check_vocab(cfg.data, cfg.model.vocab_size)
    dist.barrier()
    dp_rank, dp_size = distributed.dp_coordinates(mesh)
    train = cfg.train
    common = dict(seq_len=train.seq_len, global_batch=train.global_batch, micro_batch=train.micro_batch,
                  grad_accum=train.grad_accum, dp_rank=dp_rank, dp_size=dp_size, seed=train.seed)
    batches = batches_for(train.objective)  # preference pairs or token windows
    try:
        val = batches(cfg.data, "val", **common)
    except DataError as exc:
        if train.eval_every > 0:
            raise
        print0(f"no evaluation: {exc}", world.is_main)
        val = None
    return batches(cfg.data, "train", **common, ramp=ramp.train_ramp(cfg, dp_size)), val


def build_parallel_model(cfg: RunConfig, mesh, device: torch.device, scaler) -> tuple[nn.Module, Pipeline | None]:
    """The parallelized model; with pp > 1, this rank's stages (their parts in a ModuleList) and the schedule."""
    if cfg.sharding.pp > 1:
        # The schedule runs backward itself: its loss function applies the fp16 loss scale.
        pipeline = build_pipeline(cfg.model, mesh, cfg.sharding, cfg.train, cfg.precision, device, scaler.scale)
        return pipeline.parts, pipeline
    return parallelize(build_model(cfg.model, "meta"), mesh, cfg.sharding, cfg.train, cfg.precision, device), None


def trainable_adapters(m) -> int:
    """model.lora's adapter parameters, counted as the plan counts them (core/lora.py, the family's shapes)."""
    return adapter_count(m.lora, m.n_layers, registry.spec(m.family).linear_shapes(m))


def check_lora_supported(cfg: RunConfig) -> None:
    """The launcher refuses these layouts with LoRA; a hand-edited config.yaml meets the same line here."""
    missing = lora_unsupported(cfg.model.lora, cfg.sharding, cfg.precision)
    if missing:
        raise WorkerConfigError("; ".join(missing))


def setup(cfg: RunConfig, run_dir: Path, world: distributed.World, stop: StopRequest,
          hooks: Hooks = Hooks(), watchdog: HangWatchdog | None = None) -> Job:
    """The whole Job of this rank: mesh, model, optimizer, data, metrics, checkpoints, and where to start.

    watchdog: armed phase by phase (the mesh's groups, the model, the checkpoint read); paused for the data.
    """
    watchdog = watchdog or HangWatchdog(0.0, None)
    watchdog.arm()
    check_supported(cfg.sharding, cfg.precision)
    check_lora_supported(cfg)
    check_cp_device(cfg.sharding.cp, world.device)
    threads = distributed.set_cpu_threads(cfg.cluster, world.local_world_size)
    distributed.enable_tf32(world.device)
    distributed.seed_everything(cfg.train.seed)
    sharding, train = cfg.sharding, cfg.train
    mesh = distributed.build_mesh(ParallelDims.from_config(sharding), world.device)
    watchdog.arm()
    wrap = wrapping_of(sharding, cfg.precision)  # what parallelize wrapped with; the rest of setup follows it
    scaler = build_loss_scaler(cfg.precision, world.device)
    model, pipeline = build_parallel_model(cfg, mesh, world.device, scaler)
    use_planned_chunks(model, run_dir)
    optimizer = build_optimizer(model, cfg.optim, world.device.type, zero1_group(wrap, mesh))
    if cfg.model.lora.rank > 0:
        print0(f"lora: rank {cfg.model.lora.rank} on {', '.join(cfg.model.lora.targets)}; "
               f"{trainable_adapters(cfg.model):,} trainable parameters, the rest frozen", world.is_main)
    register_float8_scale_precompute(optimizer, model, cfg.precision, wrap.fsdp)
    watchdog.pause()  # a first tokenization or cache build is long by nature
    train_data, val_data = build_data(cfg, mesh, world)
    watchdog.arm()
    metrics = MetricsLogger(run_dir, cfg.logging, train.steps, world.is_main, asdict(cfg))
    print0(f"world {world.world_size} on {world.device}, {threads} threads/rank, strategy {sharding.strategy}, "
           f"global batch {train.global_batch} = {train.micro_batch} micro x {train.grad_accum} accum x "
           f"{train.global_batch // (train.micro_batch * train.grad_accum)} dp",
           world.is_main)
    print0(train_data.ramp.describe(train.seq_len), world.is_main and train_data.ramp.enabled)
    guard, progress = StepGuard(cfg.guards), TrainProgress(seq_len=train.seq_len, wandb_id=metrics.wandb_id)
    layout = {"global_batch": train.global_batch, "sharding": asdict(sharding),
              model_record.KEY: model_record.record(cfg.model)}  # what model the checkpoint holds
    meta = CheckpointMeta(progress, scaler, guard, layout)
    checkpoints = CheckpointManager(checkpoint_dir(run_dir), cfg.checkpoint.keep_last, cfg.checkpoint.async_save,
                                    device=world.device.type, before_commit=hooks.before_commit)
    contexts = MicroBatchContext(model=model, precision=cfg.precision, wrap=wrap,
                                 device=world.device, offload=train.activation_offload, cp_mesh=cp_mesh_of(mesh))
    watchdog.arm()  # the checkpoint read (or init_from's) gets a whole timeout of its own
    start = start_from_checkpoint(cfg, run_dir, checkpoints, model, optimizer, world)  # last: it sets the RNG
    if start.resumed:
        meta.load_state_dict(start.meta)
        train_data.resume_at(progress.step, progress.samples_seen)
    objective = build_objective(cfg, model, mesh, world.device, start.resumed)  # after the weights are loaded
    peak = device_peak_flops(world.device, cfg.precision)
    if peak:
        print0(f"mfu: {MFU_FORMULA}; peak {peak / 1e12:.0f} TFLOP/s per GPU ({cfg.precision.compute_dtype})",
               world.is_main)
    return Job(cfg=cfg, world=world, model=model, optimizer=optimizer, pipeline=pipeline, contexts=contexts,
               train_data=train_data, val_data=val_data, scaler=scaler, guard=guard, progress=progress, meta=meta,
               checkpoints=checkpoints, start=start, metrics=metrics, stop=stop, peak_flops=peak, hooks=hooks,
               watchdog=watchdog, objective=objective)


def start_from_checkpoint(cfg: RunConfig, run_dir: Path, checkpoints: CheckpointManager, model: nn.Module,
                          optimizer: torch.optim.Optimizer, world: distributed.World) -> StartPoint:
    """Restore the newest valid checkpoint of this run (or checkpoint.resume's), if any; last in setup (RNG)."""
    path, load_only = find_source(cfg.checkpoint, run_dir, checkpoints)
    if path is None:
        if cfg.checkpoint.init_from:
            init_from_hf(cfg, model, world)
        qlora_start.quantize(model, cfg.model, world.is_main)  # model.lora.base_dtype=nf4: the loaded base, in 4 bits
        return StartPoint()
    # said by metrics.resumed
    return qlora_start.around_restore(
        model, cfg.model, path, lambda: restore(checkpoints, path, load_only, model, optimizer, world.world_size,
                                                cfg.model), world.is_main)


def init_from_hf(cfg: RunConfig, model: nn.Module, world: distributed.World) -> None:
    """A fresh run starts from a Hugging Face model's weights (checkpoint.init_from); a resume never does."""
    from trainctl.models.hf import HFWeightsError, load_hf_weights

    try:
        count = load_hf_weights(model, cfg.checkpoint.init_from, cfg.model)
    except HFWeightsError as exc:
        raise WorkerConfigError(str(exc)) from None
    print0(f"initialized {count} tensors from {cfg.checkpoint.init_from}", world.is_main)


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
