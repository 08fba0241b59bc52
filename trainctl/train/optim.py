"""The optimizers core/optimizers.py names, with decay / no-decay parameter groups, and the learning-rate schedules.

Weight decay applies to the matmul weights only. Norm weights and biases (1-D) are
never decayed: shrinking them toward zero fights the normalization. The token
embedding is not decayed either (as in OLMo): each row is updated only when its
token appears, so decay would pull rare tokens to zero between their updates.
With tied embeddings the output projection is the embedding and follows it.

ZeRO-1 (sharding.strategy=zero1) keeps DDP for the gradients and wraps the optimizer in torch's
ZeroRedundancyOptimizer: each data-parallel rank holds the optimizer states of its share of
the (whole) parameter tensors, steps them, and broadcasts the updated ones to the others.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from trainctl.config.schema import OptimConfig, ScheduleConfig
from trainctl.core import optimizers
from trainctl.core.optimizers import muon_steps
from trainctl.core.schedules import lr_at as schedule_lr_at
from trainctl.core.tensors import Tensor
from trainctl.core.wrapping import Wrapping
from trainctl.models.hf import WRAPPER_SEGMENTS
from trainctl.train.errors import WorkerConfigError
from trainctl.train.inductor_isa import pin_cpu_vector_isa
from trainctl.train.lion import Lion
from trainctl.train.muon import MuonWithAdamW


def _is_muon(name: str, p: torch.Tensor) -> bool:
    """core's rule, on the full shape and the name less wrappers' segments: the plan and the worker agree."""
    plain = ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)
    return p.ndim == 2 and muon_steps(Tensor(plain, p.shape[0], p.shape[1]))


def param_groups(model: nn.Module, weight_decay: float, muon: bool = False) -> list[dict]:
    """Two groups: decayed matmul weights, and everything else with weight_decay=0.

    With `muon` the hidden matrices Muon steps come first, in a group of their own; each group says whether it is
    Muon's ("muon"), for MuonWithAdamW to split.
    """
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    hidden, decay, no_decay = [], [], []
    for name, p in model.named_parameters():  # yields a tied weight once
        if not p.requires_grad:
            continue
        if muon and _is_muon(name, p):
            hidden.append(p)
        else:
            (decay if p.ndim >= 2 and id(p) not in embeddings else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if muon:
        groups = [{"params": hidden, "weight_decay": weight_decay, "muon": True}] + [
            {**g, "muon": False} for g in groups]
    # An empty group (LoRA: every adapter is a matrix) breaks DCP's loading of the flattened optimizer state.
    return [group for group in groups if group["params"]]


def zero1_group(wrap: Wrapping, mesh: DeviceMesh) -> torch.distributed.ProcessGroup | None:
    """The data-parallel group that shares the optimizer states under zero1; None otherwise."""
    return mesh["dp_replicate"].get_group() if wrap.zero1 else None


def _adamw(cfg: OptimConfig, fused: bool) -> tuple[type[torch.optim.Optimizer], dict]:
    """Fused kernels on CUDA, multi-tensor (foreach) elsewhere."""
    return torch.optim.AdamW, dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused,
                                   foreach=not fused)


def _adafactor(cfg: OptimConfig, fused: bool) -> tuple[type[torch.optim.Optimizer], dict]:
    """torch's Adafactor: no fused kernel; foreach on CUDA, the for-loop elsewhere (torch's defaults)."""
    return torch.optim.Adafactor, dict(lr=cfg.lr, beta2_decay=cfg.beta2_decay, foreach=fused or None)


def _sgd(cfg: OptimConfig, fused: bool) -> tuple[type[torch.optim.Optimizer], dict]:
    """torch's SGD: fused on CUDA, foreach elsewhere (as AdamW)."""
    return torch.optim.SGD, dict(lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, fused=fused,
                                 foreach=not fused)


def _lion(cfg: OptimConfig, fused: bool) -> tuple[type[torch.optim.Optimizer], dict]:
    return Lion, dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


def _low_bit(cls_name: str):
    """torchao's AdamW8bit / AdamW4bit / AdamWFp8 (the fp8 extra): imported when chosen, not before. Its step is
    torch.compile'd: on CPU (not fused) Inductor's vector width is pinned first (train/inductor_isa.py)."""
    def build(cfg: OptimConfig, fused: bool) -> tuple[type[torch.optim.Optimizer], dict]:
        try:
            import torchao.optim
        except ImportError:
            raise WorkerConfigError(f"optim.name={cfg.name}: needs torchao (pip install 'trainctl[fp8]'); "
                                    "or use optim.name=adamw") from None
        if not fused:
            pin_cpu_vector_isa()
        return getattr(torchao.optim, cls_name), dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    return build


def _muon(cfg: OptimConfig, fused: bool) -> tuple[type[torch.optim.Optimizer], dict]:
    return MuonWithAdamW, dict(lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum,
                               nesterov=cfg.nesterov, adjust_lr_fn=cfg.muon_adjust_lr, betas=(cfg.beta1, cfg.beta2),
                               eps=cfg.eps, fused=fused, foreach=not fused)


# The builder of each optimizer core.optimizers describes (same names): its class and keyword arguments.
OPTIMIZER_BUILDERS = {"adamw": _adamw, "adafactor": _adafactor, "sgd": _sgd, "lion": _lion,
                      "adamw8bit": _low_bit("AdamW8bit"), "adamw4bit": _low_bit("AdamW4bit"),
                      "adamwfp8": _low_bit("AdamWFp8"), "muon": _muon}


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, device_type: str, shard_group: torch.distributed.ProcessGroup | None = None
) -> torch.optim.Optimizer:
    """The optimizer `cfg.name` names (OPTIMIZER_BUILDERS) over `param_groups`.

    With `shard_group` (zero1) it is a ZeroRedundancyOptimizer over that group. Its
    `param_groups` still list every parameter with its lr and weight decay (set_lr and
    clipping work unchanged); it copies them to its local optimizer at each step.
    """
    if cfg.name not in OPTIMIZER_BUILDERS:
        raise WorkerConfigError(f"optim.name={cfg.name!r}: unknown optimizer; use one of: "
                                f"{', '.join(OPTIMIZER_BUILDERS)}")
    groups = param_groups(model, cfg.weight_decay, muon=cfg.name == "muon")
    if not optimizers.spec(cfg.name).on_dtensor and any(isinstance(p, DTensor) for g in groups for p in g["params"]):
        raise WorkerConfigError(f"optim.name={cfg.name}: cannot step sharded (DTensor) parameters; "
                                "use sharding=ddp without tp/pp, or optim.name=adamw")
    # FSDP2 CPU offload keeps the parameters in host memory: the step runs there (no CUDA kernels).
    fused = device_type == "cuda" and all(p.device.type == "cuda" for g in groups for p in g["params"])
    cls, hyper = OPTIMIZER_BUILDERS[cfg.name](cfg, fused)
    if shard_group is None:
        return cls(groups, **hyper)
    from torch.distributed.optim import ZeroRedundancyOptimizer  # here: the package scripts its functional optimizers

    return ZeroRedundancyOptimizer(groups, optimizer_class=cls, process_group=shard_group, **hyper)


def is_zero1(optimizer: object) -> bool:
    """Whether `optimizer` is a ZeroRedundancyOptimizer, without importing torch.distributed.optim (a fifth of a
    second per worker start): one exists only once its module was imported."""
    module = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    return module is not None and isinstance(optimizer, module.ZeroRedundancyOptimizer)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):  # torchao's low-bit AdamW keeps lr a tensor (compiled step)
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def lr_at(step: int, lr: float, schedule: ScheduleConfig, total_steps: int) -> float:
    """Learning rate for 0-indexed optimizer step `step` of `total_steps` (trainctl.core.schedules)."""
    try:
        return schedule_lr_at(step, lr, schedule, total_steps)
    except ValueError as exc:
        raise WorkerConfigError(str(exc)) from None
