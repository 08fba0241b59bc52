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
from trainctl.models.llama import build_model
from trainctl.plan.flops import flops_per_token
from trainctl.plan.topology import ParallelDims
from trainctl.train import distributed as D
from trainctl.train.activations import activation_offload
from trainctl.train.context_parallel import check_cp_device, cp_mesh_of, rope_rows, sharded_sequences
from trainctl.train.data import TokenBatches, check_vocab, prepare_data
from trainctl.train.float8 import register_float8_scale_precompute
from trainctl.train.loss_scaling import DynamicLossScaler, NoLossScaling, build_loss_scaler
from trainctl.train.memory_stats import memory_record
from trainctl.train.metrics import MetricsLogger, StepTimer, device_peak_flops, print0
from trainctl.train.optim import build_optimizer, lr_at, set_lr, zero1_group
from trainctl.train.parallelize import check_supported, gradient_sync, parallelize, unwrap
from trainctl.train.pipeline import (
    Pipeline,
    build_pipeline,
    norm_over_stages,
    pipeline_eval_totals,
    pipeline_forward_backward,
    pp_group_of,
)
from trainctl.train.precision import autocast_context, uses_fsdp

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


def train_loop(job: Job) -> dict:
    """Evaluate, train `train.steps` optimizer steps with periodic logging/eval, evaluate; returns the summary."""
    cfg, train = job.cfg, job.cfg.train
    val_loss_0 = evaluate(job)
    job.metrics.eval(0, val_loss_0)
    timer, start, val_loss = StepTimer(job.world.device), time.perf_counter(), val_loss_0
    loss = grad_norm = None
    for step in range(train.steps):
        lr = lr_at(step, cfg.optim.lr, cfg.schedule, train.steps)
        set_lr(job.optimizer, lr)
        micro_batches = job.train_data.micro_batches(step)
        if job.pipeline is None:
            loss = forward_backward(job, micro_batches)
        else:
            loss = pipeline_forward_backward(job.pipeline, micro_batches)
        job.scaler.unscale_(job.optimizer)  # clip true gradients, not scaled ones
        grad_norm = clip_gradients(job.model, cfg.optim.grad_clip, pp_group_of(job.pipeline))
        job.scaler.step(job.optimizer)  # skipped (weights unchanged) if a gradient overflowed
        if step == 0:  # every model state exists now (gradients not yet zeroed): measure once
            job.metrics.memory(1, memory_record(job.model, job.optimizer))
        job.optimizer.zero_grad(set_to_none=True)
        timer.tick()
        done = step + 1
        if done % cfg.logging.log_every == 0 or done == train.steps:
            job.metrics.train(done, step_metrics(job, loss, grad_norm, lr, timer.lap(), done))
        if train.eval_every and done % train.eval_every == 0 and done != train.steps:
            val_loss = evaluate(job)
            job.metrics.eval(done, val_loss)
            timer.restart()
    if train.steps:
        val_loss = evaluate(job)
        job.metrics.eval(train.steps, val_loss)
    summary = {
        "steps": train.steps,
        "final_train_loss": float(D.all_reduce_mean(loss)) if loss is not None else None,
        "final_grad_norm": float(grad_norm) if grad_norm is not None else None,
        "final_val_loss": val_loss,
        "initial_val_loss": val_loss_0,
        "wall_time_s": time.perf_counter() - start,
        "tokens_seen": tokens_per_step(train) * train.steps,
    }
    job.metrics.final(summary)
    return summary


def tokens_per_step(train) -> int:
    return train.global_batch * train.seq_len


def token_loss_sum(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, cp_mesh: DeviceMesh | None = None) -> torch.Tensor:
    """Summed next-token cross-entropy of one micro-batch (fp32 logits for the softmax).

    With context parallelism, of this rank's slice of the sequences (sharded here, in place).
    """
    if cp_mesh is None:
        logits = model(inputs)
    else:
        freqs = rope_rows(unwrap(model), inputs.shape[1])
        with sharded_sequences(cp_mesh, inputs, targets, freqs):
            logits = model(inputs, freqs)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


def forward_backward(job: Job, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
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
        with gradient_sync(job.model, enabled=last):
            with autocast_context(precision, strategy, device), activation_offload(job.cfg.train.activation_offload, device):
                loss = token_loss_sum(job.model, inputs, targets, job.cp_mesh) / rank_tokens
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


def step_metrics(job: Job, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float, lap: tuple[float, int], step: int) -> dict:
    """The logged numbers of one step; the only per-log device sync (loss all-reduce, .item())."""
    elapsed, steps = lap
    step_time = elapsed / max(steps, 1)
    tokens_per_s = tokens_per_step(job.cfg.train) / step_time
    values = {
        "loss": D.all_reduce_mean(loss).item(),
        "lr": lr,
        "grad_norm": grad_norm.item(),
        "tokens_per_s": tokens_per_s,
        "step_time_s": step_time,
        "tokens_seen": tokens_per_step(job.cfg.train) * step,
        **job.scaler.metrics(),
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
            with autocast_context(job.cfg.precision, job.cfg.sharding.strategy, job.world.device):
                totals[0] += token_loss_sum(job.model, inputs, targets, job.cp_mesh).double()
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
    return Job(cfg, world, model, optimizer, train_data, val_data, metrics, device_peak_flops(world.device, cfg.precision.compute_dtype),
               scaler, pipeline=pipeline, cp_mesh=cp_mesh_of(mesh))


def run(cfg: RunConfig, run_dir: Path) -> dict:
    """The worker: join the world, train, write result.json; always closes W&B and the process group."""
    world = D.init_distributed(cfg.cluster, cpu_collectives=cfg.sharding.cpu_offload)
    job = None
    try:
        job = setup(cfg, run_dir, world)
        summary = train_loop(job)
        if world.is_main:
            (run_dir / "result.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary
    finally:
        if job is not None:
            job.metrics.close()
        D.close_distributed()
