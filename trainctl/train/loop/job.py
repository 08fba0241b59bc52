"""The worker's state: everything the loop reads, built completely by `job_setup.setup` (keywords only)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import nn

from trainctl.config.schema import RunConfig
from trainctl.models.common.moe import MoE, moe_blocks
from trainctl.train.checkpoint.resume import StartPoint
from trainctl.train.checkpoint.state import CheckpointMeta, TrainProgress
from trainctl.train.checkpoint.store import CheckpointManager, SaveStats
from trainctl.train.loop.data import TokenBatches
from trainctl.train.loop.guards import StepGuard
from trainctl.train.loop.hooks import Hooks
from trainctl.train.loop.loss_scaling import DynamicLossScaler, NoLossScaling
from trainctl.train.loop.micro_batch import MicroBatchContext
from trainctl.train.loop.stop import StopRequest
from trainctl.train.loop.watchdog import HangWatchdog
from trainctl.train.observe.metrics import MetricsLogger
from trainctl.train.parallel.distributed import World
from trainctl.train.parallel.pipeline import Pipeline
from trainctl.train.preference.objective import PreferenceObjective


@dataclass(kw_only=True)
class Job:
    """One rank's training job. The resumable part is Stateful (state.py): the model and optimizer through
    DCP, `meta` (progress, loss scaler, guard) as the checkpoint's meta.json."""

    cfg: RunConfig
    world: World
    model: nn.Module  # parallelized; a pipeline rank: its stages' parts
    optimizer: torch.optim.Optimizer
    pipeline: Pipeline | None  # pp > 1: this rank's stages and their schedule
    contexts: MicroBatchContext  # what every micro-batch runs under, both paths
    train_data: TokenBatches
    val_data: TokenBatches | None  # None: no val split and evaluation off (train.eval_every=0)
    scaler: NoLossScaling | DynamicLossScaler  # fp16 loss scaling (a no-op otherwise)
    guard: StepGuard
    progress: TrainProgress
    meta: CheckpointMeta  # progress, scaler and guard as one Stateful: meta.json
    checkpoints: CheckpointManager
    start: StartPoint  # where the loop begins (step 0, or a checkpoint)
    metrics: MetricsLogger
    stop: StopRequest
    peak_flops: float | None  # per device, for MFU; None where unknown
    hooks: Hooks = field(default_factory=Hooks)  # test seams (hooks.py); none in production
    watchdog: HangWatchdog = field(default_factory=lambda: HangWatchdog(0.0, None))  # off unless setup made one
    objective: PreferenceObjective | None = None  # train.objective=dpo|simpo; None: SFT (the loop's own loss)
    logged_commit: SaveStats | None = None  # the last committed save logged (each is logged once)

    @cached_property
    def expert_blocks(self) -> list[tuple[str, MoE]]:
        """The model's mixture-of-experts blocks with their layer keys, found once: the step reads their
        auxiliary loss and load (empty for a dense model)."""
        return moe_blocks(self.model)
