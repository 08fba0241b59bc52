"""Pipeline parallelism through torch.distributed.pipelining.

The model is cut into `pp x pp_stages_per_rank` stages of consecutive blocks (evenly, or as
`sharding.pp_layers` says; core/stages.py, the split the plan counts too); the first stage also
holds the embedding, the last the final norm and output head. Rank r of the pp mesh holds stages
r, r + pp, ... (the looped placement the interleaved schedules expect). Each stage is built on the
meta device as a Decoder that lacks what it does not hold, keeps the global block keys (stable names
for checkpoints), and goes through the same `parallelize` as an unsplit model (TP, float8, AC,
compile, FSDP). Init is per block and per name (see Decoder.init_weights), so a stage starts from
exactly the weights the full model would.

One optimizer step is one schedule step over this dp rank's `train.grad_accum` micro-batches,
each one pipeline microbatch. The last stage's loss is the summed token cross-entropy over
the tokens of the whole rank step (as in the unsplit loop) with `scale_grads=False`, so the
gradients match the unsplit path; the schedule itself syncs FSDP/DDP gradients after the
last microbatch. A mixture of experts' auxiliary loss, which every stage's layers add, is backpropagated
by each stage itself (stage_aux.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from trainctl.config.schema import ModelConfig, PrecisionConfig, ShardingConfig, TrainConfig
from trainctl.core.stages import local_stage_ids, stage_layers
from trainctl.models.build import family_parallel
from trainctl.models.loss_head import IGNORE_INDEX
from trainctl.train.loop.expert_load import ExpertLoad
from trainctl.train.loop.loss import TokenLoss
from trainctl.train.loop.micro_batch import MicroBatchContext
from trainctl.train.parallel.parallelize import parallelize
from trainctl.train.parallel.stage_aux import StageAux

# torch.distributed.pipelining's class of each schedule. Single-stage schedules take one stage; the interleaved
# ones a list (several stages per rank).
SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
}
MULTI_STAGE = {"interleaved_1f1b", "interleaved_zero_bubble"}


@dataclass
class Pipeline:
    """This rank's stages and the schedule that drives them."""

    schedule: object  # a torch.distributed.pipelining schedule: the training steps
    eval_schedule: object  # the same schedule over separate stage objects: forward-only evaluation
    parts: nn.ModuleList  # this rank's model parts, in stage order (optimizer, clipping, train/eval)
    group: dist.ProcessGroup  # the pp group: ranks holding the other stages of the same model copy
    is_first: bool  # holds stage 0: feeds the token ids
    is_last: bool  # holds the last stage: computes the loss
    n_microbatches: int
    rank_tokens: int  # target tokens of this rank's whole step: the loss normalizer
    device: torch.device
    loss_fn: StageLoss  # the last stage's loss; holds the unscaled microbatch losses of the last call
    stage_aux: StageAux  # a mixture of experts' auxiliary loss of every stage into the backward (stage_aux.py)


def build_stage_model(cfg: ModelConfig, layers: range, first: bool, last: bool) -> nn.Module:
    """A meta-device model holding only `layers` (global keys kept), the embedding if first, the head if last
    (the family's stage builder, models/<family>/parallel.py)."""
    return family_parallel(cfg).build_stage_model(cfg, layers, first, last)


class StageLoss:
    """The last stage's loss function: the training loss (loss.TokenLoss), times the fp16 loss scale if any.

    The schedule calls backward on what this returns, so scaling here scales every stage's
    gradients (the optimizer step then unscales them as in the unsplit loop). The unscaled
    values are kept in call order for reporting; `take()` hands them over and resets.
    """

    def __init__(self, rank_tokens: int, scale_loss: Callable[[torch.Tensor], torch.Tensor]):
        self.token_loss = TokenLoss(rank_tokens)
        self.scale_loss = scale_loss
        self.unscaled: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.token_loss(logits, targets)
        self.unscaled.append(loss.detach())
        return self.scale_loss(loss)

    def take(self) -> list[torch.Tensor]:
        values, self.unscaled = self.unscaled, []
        return values


def build_pipeline(
    model_cfg: ModelConfig,
    mesh: DeviceMesh,
    sharding: ShardingConfig,
    train: TrainConfig,
    precision: PrecisionConfig,
    device: torch.device,
    scale_loss: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss,
) -> Pipeline:
    """Split the model into this rank's stages, parallelize and materialize each, and build the schedule."""
    pp_mesh = mesh["pp"]
    group = pp_mesh.get_group()
    n_stages = sharding.pp * sharding.pp_stages_per_rank
    layers = stage_layers(model_cfg.n_layers, n_stages, list(sharding.pp_layers))
    stage_ids = local_stage_ids(pp_mesh.get_local_rank(), sharding.pp, sharding.pp_stages_per_rank)
    parts = []
    for stage_id in stage_ids:
        part = build_stage_model(model_cfg, layers[stage_id], first=stage_id == 0, last=stage_id == n_stages - 1)
        parts.append(parallelize(part, mesh, sharding, train, precision, device))
    rank_tokens = train.grad_accum * train.micro_batch * train.seq_len
    loss_fn = StageLoss(rank_tokens, scale_loss)

    # Imported here, not at module level: torch.distributed.pipelining brings in torch._dynamo (about half a second
    # of every worker's start) and a run without a pipeline never needs it.
    from torch.distributed import pipelining

    def make_schedule():
        stages = [pipelining.PipelineStage(part, stage_id, n_stages, device, group=group)
                  for part, stage_id in zip(parts, stage_ids, strict=True)]
        return getattr(pipelining, SCHEDULES[sharding.pp_schedule])(
            stages if sharding.pp_schedule in MULTI_STAGE else stages[0],
            n_microbatches=train.grad_accum,
            loss_fn=loss_fn,
            # Our loss is already normalized over the whole step: the schedule must not divide again.
            scale_grads=False,
        )

    # Two schedules over the same parts: a schedule sets its stages up on its first call, and torch 2.11 sets
    # them up for forward only when that call is eval() (the initial evaluation of a fresh run), so the first
    # training step then fails ("has gradients None"). Separate stage objects keep each set-up right.
    return Pipeline(make_schedule(), make_schedule(), nn.ModuleList(parts), group, 0 in stage_ids,
                    n_stages - 1 in stage_ids, train.grad_accum, rank_tokens, device, loss_fn,
                    StageAux(parts, scale_loss))


def _run_schedule(pipeline: Pipeline, run, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                  context: Callable[[], contextlib.AbstractContextManager]) -> list[torch.Tensor]:
    """One schedule call over `micro_batches` (concatenated, split back by the schedule); the last stage's losses.

    context: entered around the whole call, fresh each time (MicroBatchContext.forward or .autocast).
    """
    inputs = torch.cat([inputs for inputs, _ in micro_batches]).to(pipeline.device, non_blocking=True)
    targets = torch.cat([targets for _, targets in micro_batches]).to(pipeline.device, non_blocking=True)
    args = (inputs,) if pipeline.is_first else ()
    losses: list[torch.Tensor] = []
    pipeline.loss_fn.take()  # drop calls made outside a schedule step (e.g. while the stages initialize)
    # Outputs are not needed (the loss is computed inside): do not keep the merged logits.
    with context():
        run(*args, target=targets if pipeline.is_last else None, losses=losses, return_outputs=False)
    # The schedule reports one (scaled) loss per microbatch; ours are the same values unscaled,
    # in the same order, as the last calls of the loss function.
    unscaled = pipeline.loss_fn.take()
    return unscaled[len(unscaled) - len(losses):]


def sum_over_stages(value: torch.Tensor, pipeline: Pipeline) -> torch.Tensor:
    """Every pp rank gets the last stage's value (the other ranks contribute zeros)."""
    value = value if pipeline.is_last else torch.zeros_like(value)
    dist.all_reduce(value, group=pipeline.group)
    return value


def pipeline_forward_backward(pipeline: Pipeline, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                              contexts: MicroBatchContext, divisor: float | None = None,
                              adjust=None, load: ExpertLoad | None = None) -> torch.Tensor:
    """One schedule step over this rank's micro-batches; returns the rank's mean token loss, same on every pp rank.

    divisor: masked data's (loss.step_divisor: the step's counted targets); None: every target counts.
    load: a mixture of experts' auxiliary loss (backpropagated by each stage) and load (noted per stage).
    """
    pipeline.loss_fn.token_loss = TokenLoss(pipeline.rank_tokens if divisor is None else divisor, adjust)
    pipeline.stage_aux.begin(load, len(micro_batches))
    try:
        losses = _run_schedule(pipeline, pipeline.schedule.step, micro_batches, contexts.forward)
    finally:
        pipeline.stage_aux.end()
    total = torch.stack(losses).sum().detach() if pipeline.is_last else torch.zeros((), device=pipeline.device)
    return sum_over_stages(total, pipeline)


@torch.no_grad()
def pipeline_eval_totals(pipeline: Pipeline, batches: list[tuple[torch.Tensor, torch.Tensor]],
                         contexts: MicroBatchContext) -> torch.Tensor:
    """(summed token loss, tokens) over `batches`, forward only, the same on every pp rank.

    The schedule runs exactly `n_microbatches` microbatches per call: the batches go through in
    groups of that size, the last group padded with copies whose losses are dropped.
    """
    totals = torch.zeros(2, device=pipeline.device, dtype=torch.float64)
    pipeline.loss_fn.token_loss = TokenLoss(pipeline.rank_tokens)  # multiplied back below
    n = pipeline.n_microbatches
    for start in range(0, len(batches), n):
        group = batches[start : start + n]
        real = len(group)
        padded = group + [group[-1]] * (n - real)
        losses = _run_schedule(pipeline, pipeline.eval_schedule.eval, padded, contexts.autocast)
        if pipeline.is_last:
            # The loss function divides by rank_tokens; multiply back for the plain sum.
            totals[0] += torch.stack(losses[:real]).double().sum() * pipeline.rank_tokens
        totals[1] += sum(int((targets != IGNORE_INDEX).sum()) for _, targets in group)
    totals[0] = sum_over_stages(totals[0].clone(), pipeline)
    return totals


def pp_group_of(pipeline: Pipeline | None) -> dist.ProcessGroup | None:
    return pipeline.group if pipeline is not None else None


def norm_over_stages(norm: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The global 2-norm from this rank's stages' norm: squares summed over the pp group (None: no pp)."""
    if group is None:
        return norm
    squared = norm.double().pow(2)
    dist.all_reduce(squared, group=group)
    return squared.sqrt().to(norm.dtype)
