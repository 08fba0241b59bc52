"""The worker's setup: `setup(cfg, run_dir, world, stop)` builds the whole Job of this rank (job.py).

Mesh, parallelized model (or pipeline stages), optimizer, data, metrics, checkpoints, and the start point (a
resume, Hugging Face weights, or a fresh init), in that order; the loop that runs the Job is trainer.py.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from trainctl.config.schema import RunConfig
from trainctl.core import model_record
from trainctl.core.dims import ParallelDims
from trainctl.core.gpus import MFU_FORMULA
from trainctl.core.lora import adapter_count
from trainctl.core.support import lora_unsupported
from trainctl.core.wrapping import wrapping_of
from trainctl.models import registry
from trainctl.models.build import build_model
from trainctl.train.checkpoint.resume import StartPoint, find_source, restore
from trainctl.train.checkpoint.state import CheckpointMeta, TrainProgress
from trainctl.train.checkpoint.store import CheckpointManager, checkpoint_dir
from trainctl.train.errors import WorkerConfigError
from trainctl.train.loop import qlora_start, ramp
from trainctl.train.loop.data import TokenBatches
from trainctl.train.loop.data_setup import check_vocab, prepare_data
from trainctl.train.loop.guards import StepGuard
from trainctl.train.loop.hooks import Hooks
from trainctl.train.loop.job import Job
from trainctl.train.loop.loss import use_planned_chunks
from trainctl.train.loop.loss_scaling import build_loss_scaler
from trainctl.train.loop.micro_batch import MicroBatchContext
from trainctl.train.loop.sources import DataError
from trainctl.train.loop.stop import StopRequest
from trainctl.train.loop.stream import StreamBatches
from trainctl.train.loop.watchdog import HangWatchdog
from trainctl.train.observe.metrics import MetricsLogger, device_peak_flops, print0
from trainctl.train.optim import build_optimizer, zero1_group
from trainctl.train.parallel import distributed
from trainctl.train.parallel.context_parallel import check_cp_device, cp_mesh_of
from trainctl.train.parallel.float8 import register_float8_scale_precompute
from trainctl.train.parallel.parallelize import check_supported, parallelize
from trainctl.train.parallel.pipeline import Pipeline, build_pipeline
from trainctl.train.preference.setup import batches_for, build_objective, truncation_warning


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
    # preference pairs, a data=hf stream, or token windows
    batches = StreamBatches if cfg.data.kind == "hf" else batches_for(train.objective)
    try:
        val = batches(cfg.data, "val", **common)
    except DataError as exc:
        if train.eval_every > 0:
            raise
        print0(f"no evaluation: {exc}", world.is_main)
        val = None
    train_batches = batches(cfg.data, "train", **common, ramp=ramp.train_ramp(cfg, dp_size))
    warning = truncation_warning(train.seq_len, train_batches, val)
    if warning:
        print0(warning, world.is_main)
    return train_batches, val


def restore_stream(train_data, start: StartPoint) -> None:
    """A data=hf stream continues where this rank's part of the checkpoint left it; without one, refused."""
    if not isinstance(train_data, StreamBatches):
        return
    if start.data_state is None:
        raise DataError(f"data=hf: {start.path} holds no stream position for this rank (saved by "
                        f"{start.meta.get('world_size')} ranks, or from other data); resume with the world size it "
                        "was saved with, or start anew with checkpoint.load_only=model")
    train_data.load_state_dict(start.data_state)


def build_parallel_model(cfg: RunConfig, mesh, device: torch.device, scaler) -> tuple[nn.Module, Pipeline | None]:
    """The parallelized model; with pp > 1, this rank's stages (their parts in a ModuleList) and the schedule."""
    if cfg.sharding.pp > 1:
        # The schedule runs backward itself: its loss function applies the fp16 loss scale.
        pipeline = build_pipeline(cfg.model, mesh, cfg.sharding, cfg.train, cfg.precision, device, scaler.scale)
        return pipeline.parts, pipeline
    return parallelize(build_model(cfg.model, "meta"), mesh, cfg.sharding, cfg.train, cfg.precision, device), None


def trainable_adapters(m) -> int:
    """model.lora's adapter parameters, counted as the plan counts them (core/lora.py, the family's shapes)."""
    return adapter_count(m.lora, m.n_layers, registry.spec(m.family).lora_shapes(m), m.moe.num_experts)


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
    if world.device.type == "cpu" and (crowded := distributed.oversubscribed(threads, world.local_world_size)):
        print0(crowded, world.is_main)
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
        restore_stream(train_data, start)
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
