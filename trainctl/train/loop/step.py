"""One optimizer step, the same for the plain and the pipeline path, and the evaluation pass.

`train_step`: micro-batches (plain, or one pipeline schedule step) -> unscale (fp16) -> clip -> one
all-reduce that agrees on loss, norm and stop -> the guard decides -> optimizer step -> zero gradients.
Every micro-batch runs under the one MicroBatchContext (micro_batch.py); the loss is loss.TokenLoss.
With masked data the step first agrees on its counted targets (loss.step_divisor); a step where none counts
is skipped (weights unchanged), counted and warned by the guard.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from trainctl.models.loss_head import IGNORE_INDEX
from trainctl.train.loop.expert_load import ExpertLoad
from trainctl.train.loop.guards import agreed_step
from trainctl.train.loop.job import Job
from trainctl.train.loop.loss import TokenLoss, step_divisor, token_loss_sum
from trainctl.train.loop.loss_scaling import DynamicLossScaler
from trainctl.train.loop.micro_batch import MicroBatchContext
from trainctl.train.loop.ramp import step_lr
from trainctl.train.observe.memory_stats import memory_record
from trainctl.train.observe.peak_memory import PeakMeter, memory_step
from trainctl.train.optim import set_lr
from trainctl.train.parallel.pipeline import (
    norm_over_stages,
    pipeline_eval_totals,
    pipeline_forward_backward,
    pp_group_of,
)
from trainctl.train.parallel.tensor_parallel import settle_partial_gradients


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step reports, agreed across ranks."""

    step: int  # steps done (1-based, as logged)
    loss: float
    grad_norm: float
    lr: float
    stop: bool  # some rank was asked to stop: every rank saves this step and leaves
    memory: dict | None = None  # the measured peak of this step, on the one step that measures it
    extra: dict | None = None  # the objective's own agreed metrics (preference tuning: rewards, accuracy)


def train_step(job: Job, step: int) -> StepResult:
    """Optimizer step `step` (0-based); see the module doc for the order."""
    lr = step_lr(job, step)  # on the tokens trained before it (train.batch_ramp; without one: the step's)
    set_lr(job.optimizer, lr)
    micro_batches = job.train_data.micro_batches(step)
    divisor = None  # unmasked: every target counts, the count is known without a sync
    if job.train_data.masked:
        divisor = step_divisor(micro_batches, job.contexts.cp, job.world.device)
        if divisor == 0:
            return skip_empty_step(job, step, lr)
    # One step's peak is measured, once optimizer states exist and DDP has rebuilt its buckets.
    # after a batch ramp: the plan predicts the full batch's (its accumulated gradients)
    measured = step == memory_step(max(job.start.step, job.train_data.ramp.steps), job.cfg.train.steps)
    meter = PeakMeter(job.world.device, job.model, job.optimizer) if measured else None
    on_loss = job.hooks.on_loss
    adjust = None if on_loss is None else functools.partial(on_loss, step)
    # A mixture of experts' auxiliary loss and load (nothing for a dense model); under pp this rank's layers'.
    load = ExpertLoad(job.expert_blocks, pp_group_of(job.pipeline))
    if job.objective is not None:  # preference tuning (train/preference/objective.py); pp is refused for it
        local_loss = job.objective.forward_backward(job.model, micro_batches, job.contexts, job.scaler.scale, adjust)
    elif job.pipeline is None:
        local_loss = forward_backward(job.model, micro_batches, job.contexts, job.scaler.scale, divisor, adjust, load)
    else:
        local_loss = pipeline_forward_backward(job.pipeline, micro_batches, job.contexts, divisor, adjust, load)
    settle_partial_gradients(job.model)  # TP's partial sums reduced once, before the clip and the step
    job.scaler.unscale_(job.optimizer)  # clip true gradients, not scaled ones
    local_norm = clip_gradients(job.model, job.cfg.optim.grad_clip, pp_group_of(job.pipeline))
    # One all-reduce: every rank judges the same loss and norm, and learns of any stop request.
    loss, grad_norm, stop = agreed_step(local_loss, local_norm, job.stop.requested)
    # Under fp16 an overflowing gradient is routine: the loss scaler skips that step itself.
    guard_norm = 0.0 if isinstance(job.scaler, DynamicLossScaler) else grad_norm
    if job.guard.decide(step + 1, loss, guard_norm) == "ok":  # steps are named as logged: 1-based
        with meter.optimizer_step() if meter is not None else contextlib.nullcontext():  # its temporaries apart
            job.scaler.step(job.optimizer)  # skipped (weights unchanged) if a gradient overflowed
    # Every model state exists now (gradients not yet zeroed): measure once.
    memory = memory_record(job.model, job.optimizer, meter.stop()) if meter is not None else None
    job.optimizer.zero_grad(set_to_none=True)
    extra = {**((job.objective.last or {}) if job.objective is not None else {}), **load.finish()}
    return StepResult(step + 1, loss, grad_norm, lr, stop, memory, extra or None)


def skip_empty_step(job: Job, step: int, lr: float) -> StepResult:
    """A step whose masks leave no counted target anywhere: no forward, no optimizer step; the stop request
    is still agreed (the same all-reduce as a real step), and the guard counts and warns."""
    zero = torch.zeros((), device=job.world.device)
    _, _, stop = agreed_step(zero, zero, job.stop.requested)
    job.guard.note_empty(step + 1)
    job.optimizer.zero_grad(set_to_none=True)
    return StepResult(step + 1, 0.0, 0.0, lr, stop)


def forward_backward(model: nn.Module, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                     contexts: MicroBatchContext, scale_loss=lambda loss: loss,
                     divisor: float | None = None, adjust=None, load: ExpertLoad | None = None) -> torch.Tensor:
    """Accumulate gradients over this rank's micro-batches; returns this rank's mean token loss (no sync).

    divisor: masked data's (loss.step_divisor); None: every target counts. adjust: hooks.on_loss of this step.
    load: a mixture of experts' auxiliary loss, added to each micro-batch's loss (not to the returned one).
    """
    device = contexts.device
    if divisor is None:
        # Every micro-batch is full (no padding), so the count is known without a device sync;
        # a cp rank holds 1/cp of each sequence.
        divisor = sum(targets.numel() for _, targets in micro_batches) // contexts.cp
    token_loss = TokenLoss(divisor, adjust)
    total = torch.zeros((), device=device)
    for index, batch in enumerate(micro_batches):
        inputs, targets = (t.to(device, non_blocking=True) for t in batch)
        positions = _positions_on(batch, device)
        # Under cp the backward stays inside around_backward: it runs the ring's backward.
        with contexts.around_backward(inputs, targets, last=index == len(micro_batches) - 1) as freqs:
            with contexts.forward():
                loss = token_loss.of_model(model, inputs, targets, freqs, positions)
                aux = load.take(len(micro_batches)) if load is not None else None
            scale_loss(loss if aux is None else loss + aux).backward()
        total += loss.detach()
    return total


def _positions_on(batch: tuple, device: torch.device) -> torch.Tensor | None:
    """A micro-batch's document positions (data.document_mask; train.data.MicroBatch) on `device`, else None."""
    positions = getattr(batch, "positions", None)
    return None if positions is None else positions.to(device, non_blocking=True)


def clip_gradients(model: nn.Module, max_norm: float, pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Clip to global norm `max_norm` (0: no clipping); returns the pre-clip norm, as a tensor, unsynced.

    FSDP and TP gradients are DTensors (shards; TP's partial sums were reduced by settle_partial_gradients):
    their norm is a DTensor that `full_tensor` reduces over every mesh dim. The norm is computed once
    and then applied, because clip_grad_norm_ fails on gradients of different meshes.
    """
    groups = grads_by_mesh([p for p in model.parameters() if p.grad is not None])
    norms = [_full(torch.nn.utils.get_total_norm([p.grad for p in group])) for group in groups]
    # Expert parallelism puts the experts' gradients on a mesh of their own: one norm per mesh, then their norm.
    norm = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
    norm = norm_over_stages(norm, pp_group)  # pipeline: add the other stages' gradients
    if max_norm > 0:
        for group in groups:
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return norm


def grads_by_mesh(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Parameters grouped by their gradients' mesh (plain tensors together): DTensor ops refuse mixed meshes."""
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    return list(groups.values()) or [[]]


def _full(norm: torch.Tensor) -> torch.Tensor:
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


@torch.no_grad()
def evaluate(job: Job) -> tuple[float, int]:
    """(mean token loss, the targets it averages) over the held-out batches of every rank (validation keeps
    eval_batches >= 1 when it runs); no counted target (every one masked) is a nan loss over 0 targets."""
    job.model.eval()
    batches = job.val_data.eval_batches(job.cfg.train.eval_batches)
    if job.objective is not None:  # the mean pair loss, already agreed over the ranks
        result = job.objective.evaluate(job.model, batches, job.contexts)
        job.model.train()
        return result
    if job.pipeline is not None:
        totals = pipeline_eval_totals(job.pipeline, batches, job.contexts)  # the same on every stage
    else:
        totals = eval_totals(job.model, batches, job.contexts)
    job.model.train()
    # Ranks that share data (tp, pp) add equal copies to both sums: the ratio is unchanged;
    # cp ranks add disjoint slices of the same sequences.
    if dist.get_world_size() > 1:
        dist.all_reduce(totals)
    return (totals[0] / totals[1]).item(), int(totals[1].item())


def eval_totals(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
                contexts: MicroBatchContext) -> torch.Tensor:
    """(summed token loss, tokens) of this rank's held-out batches, float64."""
    totals = torch.zeros(2, device=contexts.device, dtype=torch.float64)
    for batch in batches:
        inputs, targets = (t.to(contexts.device) for t in batch)
        positions = _positions_on(batch, contexts.device)
        with contexts.sequences(inputs, targets) as freqs, contexts.autocast():
            totals[0] += token_loss_sum(model, inputs, targets, freqs, positions).double()
        totals[1] += (targets != IGNORE_INDEX).sum()  # after the call: a cp rank's own slice; masks honoured
    return totals
