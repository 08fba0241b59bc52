"""The fixed training loop. `run(cfg, run_dir)` is the worker's top level; `train_loop` the loop.

Loss normalization: each rank divides its summed token cross-entropy by the number of
target tokens it sees in the whole optimizer step (all its micro-batches). Every dp rank
sees the same count, so DDP/FSDP's gradient averaging over dp ranks finishes the job:
the gradient equals that of the mean loss over every token of the global batch, whatever
the split into ranks and micro-batches.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from trainctl.config.schema import RunConfig
from trainctl.core import rundir
from trainctl.models.llama import build_model
from trainctl.plan.flops import flops_per_token
from trainctl.plan.topology import ParallelDims
from trainctl.train import distributed as D
from trainctl.train import state as S
from trainctl.train.activations import activation_offload
from trainctl.train.checkpoint import CheckpointManager, checkpoint_dir, step_name
from trainctl.train.context_parallel import check_cp_device, cp_mesh_of, sharded_sequences
from trainctl.train.data import TokenBatches, check_vocab, prepare_data
from trainctl.train.errors import WorkerConfigError
from trainctl.train.float8 import register_float8_scale_precompute
from trainctl.train.guards import StepGuard, agreed_step, inject_nan
from trainctl.train.loss_scaling import DynamicLossScaler, NoLossScaling, build_loss_scaler
from trainctl.train.memory_stats import memory_record
from trainctl.train.metrics import MetricsLogger, StepTimer, device_peak_flops, print0
from trainctl.train.optim import build_optimizer, lr_at, set_lr, zero1_group
from trainctl.train.parallelize import check_supported, gradient_sync, parallelize, unwrap
from trainctl.train.peak_memory import PeakMeter, memory_step
from trainctl.train.pipeline import (
    Pipeline,
    build_pipeline,
    norm_over_stages,
    pipeline_eval_totals,
    pipeline_forward_backward,
    pp_group_of,
)
from trainctl.train.precision import autocast_context, uses_fsdp
from trainctl.train.resume import StartPoint, find_source, restore
from trainctl.train.stop import StopRequest, requeue_slurm_job

log = logging.getLogger("trainctl.train")


@dataclass
class Job:
    """Everything the loop needs, built once by `setup`."""

    cfg: RunConfig
    world: D.World
    model: nn.Module
    optimizer: torch.optim.Optimizer
    train_data: TokenBatches
    val_data: TokenBatches
    metrics: MetricsLogger
    peak_flops: float | None
    scaler: NoLossScaling | DynamicLossScaler = field(default_factory=NoLossScaling)  # fp16 loss scaling
    pipeline: Pipeline | None = None  # pp > 1: this rank's stages and their schedule (model: their parts)
    cp_mesh: DeviceMesh | None = None  # cp > 1: the ranks that share each sequence
    checkpoints: CheckpointManager | None = None
    start: StartPoint = field(default_factory=StartPoint)
    guard: StepGuard | None = None
    stop: StopRequest = field(default_factory=StopRequest)
    logged_commit: object = None  # the last SaveStats logged


def train_loop(job: Job) -> dict:
    """Train from the start point to `train.steps` with logging, eval and checkpoints; returns the summary.

    A stop request (signal) ends the loop early with a checkpoint; the summary says so.
    """
    cfg, train, begin = job.cfg, job.cfg.train, job.start.step
    if begin > train.steps or (begin == train.steps and not resumed_own_run(job)):
        raise WorkerConfigError(f"train.steps={train.steps}: the checkpoint {job.start.path} is at step {begin} already; "
                                "nothing left to train (launch a new run, or resume from it with checkpoint.resume=PATH)")
    # begin == train.steps here: a restart after the final checkpoint (a crash or preemption
    # before result.json was written); the loop below is empty and the run just finishes.
    if job.start.resumed:
        val_loss_0 = job.start.meta.get("initial_val_loss", float("nan"))
        job.metrics.resumed(begin, str(job.start.path))  # drops what an earlier attempt logged past `begin`
    else:
        val_loss_0 = evaluate(job)
        job.metrics.eval(0, val_loss_0)
    job.stop.armed = True  # from here a stop signal means: finish the step, save, leave
    timer, start, val_loss = StepTimer(job.world.device), time.perf_counter(), val_loss_0
    # The last step's numbers, for a summary even when no step is left to run.
    loss, grad_norm = job.start.meta.get("train_loss"), job.start.meta.get("grad_norm")
    stopped_at = None
    for step in range(begin, train.steps):
        lr = lr_at(step, cfg.optim.lr, cfg.schedule, train.steps)
        set_lr(job.optimizer, lr)
        micro_batches = job.train_data.micro_batches(step)
        # One step's peak is measured, once optimizer states exist and DDP has rebuilt its buckets.
        meter = PeakMeter(job.world.device, job.model, job.optimizer) if step == memory_step(begin, train.steps) else None
        if job.pipeline is None:
            local_loss = forward_backward(job, micro_batches, step)
        else:
            local_loss = pipeline_forward_backward(job.pipeline, micro_batches)
        job.scaler.unscale_(job.optimizer)  # clip true gradients, not scaled ones
        local_norm = clip_gradients(job.model, cfg.optim.grad_clip, pp_group_of(job.pipeline))
        # One all-reduce: every rank judges the same loss and norm, and learns of any stop request.
        loss, grad_norm, stop = agreed_step(local_loss, local_norm, job.stop.wanted(step + 1))
        # Under fp16 an overflowing gradient is routine: the loss scaler skips that step itself.
        guard_norm = 0.0 if isinstance(job.scaler, DynamicLossScaler) else grad_norm
        if job.guard.decide(step + 1, loss, guard_norm) == "ok":  # steps are named as logged: 1-based
            job.scaler.step(job.optimizer)  # skipped (weights unchanged) if a gradient overflowed
        if meter is not None:  # every model state exists now (gradients not yet zeroed): measure once
            job.metrics.memory(step + 1, memory_record(job.model, job.optimizer, meter.stop()))
        job.optimizer.zero_grad(set_to_none=True)
        timer.tick()
        done = step + 1
        if done % cfg.logging.log_every == 0 or done == train.steps or stop:
            job.metrics.train(done, step_metrics(job, loss, grad_norm, lr, timer.lap(), done))
        if train.eval_every and done % train.eval_every == 0 and done != train.steps and not stop:
            val_loss = evaluate(job)
            job.metrics.eval(done, val_loss)
            timer.restart()
        job.checkpoints.poll()
        log_commit(job)
        if stop:
            stopped_at = done
            break
        if cfg.checkpoint.every and done % cfg.checkpoint.every == 0 and done != train.steps:
            save_checkpoint(job, done, val_loss_0, loss, grad_norm)
    if stopped_at is not None:
        save_checkpoint(job, stopped_at, val_loss_0, loss, grad_norm)
    else:
        val_loss = evaluate(job)
        job.metrics.eval(train.steps, val_loss)
        if cfg.checkpoint.save_final and train.steps > begin:
            save_checkpoint(job, train.steps, val_loss_0, loss, grad_norm)
    job.checkpoints.wait()
    log_commit(job)
    summary = {
        "steps": stopped_at or train.steps,
        "stopped": stopped_at is not None,
        "resumed_from_step": begin,
        "final_train_loss": loss,
        "final_grad_norm": grad_norm,
        "final_val_loss": val_loss,
        "initial_val_loss": val_loss_0,
        "wall_time_s": time.perf_counter() - start,
        "tokens_seen": tokens_per_step(train) * (stopped_at or train.steps),
        **job.guard.metrics(),
    }
    job.metrics.final(summary)
    return summary


def resumed_own_run(job: Job) -> bool:
    """Whether the start point is a checkpoint of this run's own (not one given by checkpoint.resume=PATH)."""
    path = job.start.path
    return path is not None and path.resolve().parent == job.checkpoints.root.resolve()


def save_checkpoint(job: Job, step: int, initial_val_loss: float, train_loss: float | None, grad_norm: float | None) -> None:
    """Checkpoint after `step` optimizer steps (see state.py for what it holds)."""
    meta = {
        "step": step,
        "samples_seen": job.train_data.first_sample(step),
        "tokens_seen": job.train_data.first_sample(step) * job.cfg.train.seq_len,
        "global_batch": job.cfg.train.global_batch,
        "sharding": asdict(job.cfg.sharding),
        "wandb_id": job.metrics.wandb_id,
        "scaler": job.scaler.state_dict(),
        "guard": job.guard.state_dict(),
        "initial_val_loss": initial_val_loss,
        "train_loss": train_loss,  # the step's agreed loss and norm: the summary of a run restarted after its last step
        "grad_norm": grad_norm,
    }
    job.checkpoints.save(step, S.app_state(job.model, job.optimizer), S.rank_state(job.optimizer), meta)
    log_commit(job)


def log_commit(job: Job) -> None:
    """Log a save once it is committed (at once when sync; at a later poll/wait when async)."""
    stats = job.checkpoints.stats
    if stats is not None and stats != job.logged_commit:
        job.logged_commit = stats
        job.metrics.checkpoint(stats.step, {"blocking_s": stats.blocking_s, "total_s": stats.total_s, "bytes": stats.bytes})


def tokens_per_step(train) -> int:
    return train.global_batch * train.seq_len


def token_loss_sum(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, freqs: torch.Tensor | None = None) -> torch.Tensor:
    """Summed next-token cross-entropy of one micro-batch (fp32 logits for the softmax).

    freqs: the RoPE rows of the tokens, for a context-parallel slice (see sharded_sequences).
    """
    logits = model(inputs) if freqs is None else model(inputs, freqs)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


def forward_backward(job: Job, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], step: int = -1) -> torch.Tensor:
    """Accumulate gradients over this rank's micro-batches; returns this rank's mean token loss (no sync)."""
    device, precision, strategy = job.world.device, job.cfg.precision, job.cfg.sharding.strategy
    # Every micro-batch is full (no padding), so the count is known without a device sync;
    # a cp rank holds 1/cp of each sequence.
    cp = job.cp_mesh.size() if job.cp_mesh is not None else 1
    rank_tokens = sum(targets.numel() for _, targets in micro_batches) // cp
    total = torch.zeros((), device=device)
    for index, (inputs, targets) in enumerate(micro_batches):
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        last = index == len(micro_batches) - 1
        # Under cp the backward stays inside sharded_sequences: it runs the ring's backward.
        with gradient_sync(job.model, enabled=last), sharded_sequences(job.cp_mesh, unwrap(job.model), inputs, targets) as freqs:
            with autocast_context(precision, strategy, device), activation_offload(job.cfg.train.activation_offload, device):
                loss = token_loss_sum(job.model, inputs, targets, freqs) / rank_tokens
                loss = inject_nan(loss, step + 1, job.cfg.guards.inject_nan_step)
            job.scaler.scale(loss).backward()
        total += loss.detach()
    return total


def clip_gradients(model: nn.Module, max_norm: float, pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Clip to global norm `max_norm` (0: no clipping); returns the pre-clip norm, as a tensor, unsynced.

    FSDP and TP gradients are DTensors (shards, or TP's partial sums for the norm weights): their
    norm is a DTensor that `full_tensor` reduces over every mesh dim. The norm is computed once
    and then applied, because clip_grad_norm_ fails on gradients of different meshes.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    norm = norm_over_stages(norm, pp_group)  # pipeline: add the other stages' gradients
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def step_metrics(job: Job, loss: float, grad_norm: float, lr: float, lap: tuple[float, int], step: int) -> dict:
    """The logged numbers of one step (loss and norm already agreed across ranks)."""
    elapsed, steps = lap
    step_time = elapsed / max(steps, 1)
    tokens_per_s = tokens_per_step(job.cfg.train) / step_time
    values = {
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens_per_s": tokens_per_s,
        "step_time_s": step_time,
        "tokens_seen": tokens_per_step(job.cfg.train) * step,
        **job.scaler.metrics(),
        **job.guard.metrics(),
    }
    if job.peak_flops:
        flops = flops_per_token(job.cfg.model, job.cfg.train.seq_len) * tokens_per_s
        values["mfu"] = flops / (job.world.world_size * job.peak_flops)
    if job.world.device.type == "cuda":
        values["peak_mem_gib"] = torch.cuda.max_memory_allocated(job.world.device) / 2**30
    return values


@torch.no_grad()
def evaluate(job: Job) -> float:
    """Mean token loss over the held-out batches of every rank."""
    if job.cfg.train.eval_batches <= 0:
        return float("nan")
    job.model.eval()
    totals = torch.zeros(2, device=job.world.device, dtype=torch.float64)  # (loss sum, tokens)
    batches = job.val_data.eval_batches(job.cfg.train.eval_batches)
    if job.pipeline is not None:
        totals = pipeline_eval_totals(job.pipeline, batches)  # the same on every stage
    else:
        for inputs, targets in batches:
            inputs, targets = inputs.to(job.world.device), targets.to(job.world.device)
            with sharded_sequences(job.cp_mesh, unwrap(job.model), inputs, targets) as freqs:
                with autocast_context(job.cfg.precision, job.cfg.sharding.strategy, job.world.device):
                    totals[0] += token_loss_sum(job.model, inputs, targets, freqs).double()
            totals[1] += targets.numel()  # after the call: a cp rank's own slice
    job.model.train()
    # Ranks that share data (tp, pp) add equal copies to both sums: the ratio is unchanged;
    # cp ranks add disjoint slices of the same sequences.
    if dist.get_world_size() > 1:
        dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def build_data(cfg: RunConfig, mesh, world: D.World) -> tuple[TokenBatches, TokenBatches]:
    """Train and val batches for this rank's data-parallel coordinates; rank 0 builds caches first."""
    if world.is_main:
        prepare_data(cfg.data)
        check_vocab(cfg.data, cfg.model.vocab_size)
    dist.barrier()
    dp_rank, dp_size = D.dp_coordinates(mesh)
    t = cfg.train
    common = dict(seq_len=t.seq_len, global_batch=t.global_batch, micro_batch=t.micro_batch,
                  grad_accum=t.grad_accum, dp_rank=dp_rank, dp_size=dp_size, seed=t.seed)
    return TokenBatches(cfg.data, "train", **common), TokenBatches(cfg.data, "val", **common)


def build_parallel_model(cfg: RunConfig, mesh, device: torch.device, scaler) -> tuple[nn.Module, Pipeline | None]:
    """The parallelized model; with pp > 1, this rank's stages (their parts in a ModuleList) and the schedule."""
    if cfg.sharding.pp > 1:
        # The schedule runs backward itself: its loss function applies the fp16 loss scale.
        pipeline = build_pipeline(cfg.model, mesh, cfg.sharding, cfg.train, cfg.precision, device, scaler.scale)
        return pipeline.parts, pipeline
    return parallelize(build_model(cfg.model, "meta"), mesh, cfg.sharding, cfg.train, cfg.precision, device), None


def setup(cfg: RunConfig, run_dir: Path, world: D.World) -> Job:
    """Mesh, model, optimizer, data and metrics for this rank."""
    check_supported(cfg.sharding, cfg.precision)
    check_cp_device(cfg.sharding.cp, world.device)
    threads = D.set_cpu_threads(cfg.cluster, world.local_world_size)
    D.enable_tf32(world.device)
    D.seed_everything(cfg.train.seed)
    s = cfg.sharding
    mesh = D.build_mesh(ParallelDims(s.dp_replicate, s.dp_shard, s.cp, s.tp, s.pp), world.device)
    scaler = build_loss_scaler(cfg.precision, world.device)
    model, pipeline = build_parallel_model(cfg, mesh, world.device, scaler)
    optimizer = build_optimizer(model, cfg.optim, world.device.type, zero1_group(s.strategy, mesh))
    register_float8_scale_precompute(optimizer, model, cfg.precision, uses_fsdp(s.strategy))
    train_data, val_data = build_data(cfg, mesh, world)
    metrics = MetricsLogger(run_dir, cfg.logging, cfg.train.steps, world.is_main, asdict(cfg))
    print0(f"world {world.world_size} on {world.device}, {threads} threads/rank, strategy {s.strategy}, "
           f"global batch {cfg.train.global_batch} = {cfg.train.micro_batch} micro x {cfg.train.grad_accum} accum x dp", world.is_main)
    job = Job(cfg, world, model, optimizer, train_data, val_data, metrics, device_peak_flops(world.device, cfg.precision.compute_dtype),
              scaler, pipeline=pipeline, cp_mesh=cp_mesh_of(mesh), guard=StepGuard(cfg.guards))
    job.checkpoints = CheckpointManager(checkpoint_dir(run_dir), cfg.checkpoint.keep_last, cfg.checkpoint.async_save)
    start_from_checkpoint(job, run_dir)
    return job


def report_stop(job: Job, run_dir: Path, step: int) -> None:
    """After the stop checkpoint committed: rank 0 records the stop and says how to go on; requeue on preemption."""
    cfg, stop = job.cfg, job.stop
    if not job.world.is_main:
        return
    saved = checkpoint_dir(run_dir) / step_name(step)
    if stop.signal_name:  # the test hook's stop names no signal: nobody asked, nothing to record
        rundir.record_stop(run_dir, step, stop.signal_name, saved.name)
    # The early preemption warning (not a plain SIGTERM, e.g. scancel): back to the queue.
    if stop.preempted and cfg.cluster.launcher == "slurm" and cfg.cluster.preemption.requeue and requeue_slurm_job():
        return
    by = f" by {stop.signal_name}" if stop.signal_name else ""
    log.warning("stopped%s after step %d: checkpoint %s committed; continue with `trainctl resume %s`",
                by, step, saved.name, run_dir.name)


def start_from_checkpoint(job: Job, run_dir: Path) -> None:
    """Restore the newest valid checkpoint of this run (or checkpoint.resume's), if any; last in setup (RNG)."""
    path, load_only = find_source(job.cfg.checkpoint, run_dir, job.checkpoints)
    if path is None:
        return
    job.start = restore(job.checkpoints, path, load_only, job.model, job.optimizer, job.world.world_size)
    if job.start.resumed:
        job.train_data.resume_at(job.start.step, job.start.samples_seen)
        job.scaler.load_state_dict(job.start.meta["scaler"])
        job.guard.load_state_dict(job.start.meta["guard"])
        print0(f"resumed from {path} at step {job.start.step} ({job.start.samples_seen} samples seen)", job.world.is_main)


def run(cfg: RunConfig, run_dir: Path, stop: StopRequest | None = None, on_error=None) -> dict:
    """The worker: join the world, train, write result.json; always closes W&B and the process group.

    stop: installed by the caller as early as it can (a signal during setup ends the worker at once).
    on_error(exc): called before the error propagates, while the process group is still up: a peer waiting
    on us fails ("connection closed") only once we close it, so what on_error records comes first.
    """
    world = D.init_distributed(cfg.cluster, cpu_collectives=cfg.sharding.cpu_offload)
    job = None
    try:
        job = setup(cfg, run_dir, world)
        job.stop = stop or StopRequest(cfg.cluster.preemption.signal)
        summary = train_loop(job)
        if summary["stopped"]:
            report_stop(job, run_dir, summary["steps"])
        elif world.is_main:
            (run_dir / rundir.RESULT).write_text(json.dumps(summary, indent=2) + "\n")
        return summary
    except BaseException as exc:
        if on_error is not None:
            on_error(exc)
        raise
    finally:
        if job is not None:
            job.metrics.close()
        D.close_distributed()
