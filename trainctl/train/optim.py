"""AdamW with decay / no-decay parameter groups, and the learning-rate schedules.

Weight decay applies to the matmul weights only. Norm weights and biases (1-D) are
never decayed: shrinking them toward zero fights the normalization. The token
embedding is not decayed either (as in OLMo): each row is updated only when its
token appears, so decay would pull rare tokens to zero between their updates.
With tied embeddings the output projection is the embedding and follows it.

ZeRO-1 (sharding.strategy=zero1) keeps DDP for the gradients and wraps AdamW in torch's
ZeroRedundancyOptimizer: each data-parallel rank holds the AdamW states of its share of
the (whole) parameter tensors, steps them, and broadcasts the updated ones to the others.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.optim import ZeroRedundancyOptimizer

from trainctl.config.schema import OptimConfig, ScheduleConfig
from trainctl.core.wrapping import Wrapping
from trainctl.plan.schedule import lr_at as schedule_lr_at
from trainctl.train.errors import WorkerConfigError


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: decayed matmul weights, and everything else with weight_decay=0."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for p in model.parameters():  # yields a tied weight once
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 and id(p) not in embeddings else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # An empty group (LoRA: every adapter is a matrix) breaks DCP's loading of the flattened optimizer state.
    return [group for group in groups if group["params"]]


def zero1_group(wrap: Wrapping, mesh: DeviceMesh) -> torch.distributed.ProcessGroup | None:
    """The data-parallel group that shares the optimizer states under zero1; None otherwise."""
    return mesh["dp_replicate"].get_group() if wrap.zero1 else None


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, device_type: str, shard_group: torch.distributed.ProcessGroup | None = None
) -> torch.optim.Optimizer:
    """AdamW over `param_groups`: fused kernels on CUDA, multi-tensor (foreach) elsewhere.

    With `shard_group` (zero1) it is a ZeroRedundancyOptimizer over that group. Its
    `param_groups` still list every parameter with its lr and weight decay (set_lr and
    clipping work unchanged); it copies them to its local AdamW at each step.
    """
    groups = param_groups(model, cfg.weight_decay)
    # FSDP2 CPU offload keeps the parameters in host memory: the step runs there (no CUDA kernels).
    fused = device_type == "cuda" and all(p.device.type == "cuda" for g in groups for p in g["params"])
    hyper = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused, foreach=not fused)
    if shard_group is None:
        return torch.optim.AdamW(groups, **hyper)
    return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, process_group=shard_group, **hyper)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def lr_at(step: int, lr: float, schedule: ScheduleConfig, total_steps: int) -> float:
    """Learning rate for 0-indexed optimizer step `step` of `total_steps` (trainctl.plan.schedule)."""
    try:
        return schedule_lr_at(step, lr, schedule, total_steps)
    except ValueError as exc:
        raise WorkerConfigError(str(exc)) from None
