"""What a checkpoint holds, and how it maps onto the live job.

DCP part (resharded on load, so a checkpoint loads into another world size or layout):
  model   torch's get_model_state_dict over the model's pieces, under the full model's names
          (layers.3.attention.wq.weight): wrappers (DDP, compile, checkpointing) and the pipeline
          split leave no trace in the names. QLoRA's NF4 base under FSDP2 is saved whole (gathered), as
          one process or DDP saves it: DCP cannot cut an NF4 tensor at another layout's row offsets, so
          a sharded one would load only into the same layout, and not into export's whole tensors.
  optim   get_optimizer_state_dict, keyed by the same names (AdamW moments and step counts).
Per rank (rank_state): RNG states of python, numpy, torch CPU and CUDA; zero1's optimizer shard
  (ZeroRedundancyOptimizer partitions whole tensors by rank, so its shards do not reshard).
meta.json (`CheckpointMeta`): step, samples and tokens seen, the layout it was saved with, what model it holds
  (core/model_record.py: checked by resume, export, generate and eval), the W&B run id, the loss-scaler and guard
  state, the first eval loss, the last step's loss and gradient norm. The LR schedule is a function of the step.
Every part is a torch.distributed.checkpoint Stateful (state_dict / load_state_dict): DCP calls the model's
and the optimizer's itself, on save and on load; meta.json is CheckpointMeta's state_dict.
"""

from __future__ import annotations

import dataclasses
import math
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from trainctl.models.common.quantized import gathered, is_nf4, own_rows, quantized_like
from trainctl.train.errors import WorkerConfigError
from trainctl.train.optim import is_zero1


def named_view(model: nn.Module) -> nn.Module:
    """A module whose parameter names are the full model's, whatever wraps or splits it.

    A pipeline rank holds its stages as a ModuleList of partial Llamas ("0.layers.2..."): the
    view re-parents their pieces under one module, so names match a single-process model.
    """
    model = model.module if isinstance(model, DistributedDataParallel) else model
    if not isinstance(model, nn.ModuleList):
        return model
    view = nn.Module()
    layers = nn.ModuleDict()
    for part in model:
        for name in ("tok_embeddings", "norm", "output"):
            if getattr(part, name, None) is not None:
                setattr(view, name, getattr(part, name))
        for key, block in part.layers.items():
            layers[key] = block
    view.layers = layers
    return view


def _options() -> StateDictOptions:
    # Sharded (DTensor) state: each rank saves and loads only its shards; DCP reshards between layouts.
    # Flattened optimizer state ("param_groups.<name>.lr"): with nested param_groups, a list per
    # rank, DCP would keep one rank's list for all (pipeline stages hold different parameters).
    return StateDictOptions(full_state_dict=False, cpu_offload=False, flatten_optimizer_state_dict=True)


class ModelState(Stateful):
    """The model's DCP state under the full model's names (see named_view).

    skip: names left out (LoRA adapters a full run's checkpoint lacks, when a LoRA run starts from its weights);
    DCP still refuses a checkpoint that lacks any other tensor.
    nf4_source: on load, whether the checkpoint holds QLoRA's base as NF4 (else fp32, quantized here whole).
    """

    def __init__(self, view: nn.Module, skip: frozenset[str] = frozenset(), nf4_source: bool = True):
        self.view, self.skip, self.nf4_source = view, skip, nf4_source

    def state_dict(self) -> dict:
        return {k: self._whole(v) for k, v in get_model_state_dict(self.view, options=_options()).items()
                if k not in self.skip}

    def _whole(self, value):
        """An FSDP2-sharded NF4 weight whole (module doc): gathered, or an fp32 tensor for an fp32 source to
        load into."""
        if not (isinstance(value, DTensor) and is_nf4(value)):
            return value
        if self.nf4_source:
            return gathered(value)
        return torch.empty(value.shape, dtype=value.dtype, device=value.to_local().quantized_data.device)

    def load_state_dict(self, state: dict) -> None:
        live = get_model_state_dict(self.view, options=_options())
        for name, value in state.items():
            param = live.get(name)
            if isinstance(param, DTensor) and is_nf4(param):  # this rank's rows of the whole, as DTensor
                rows = own_rows(quantized_like(value, param.to_local()), param)
                state[name] = DTensor.from_local(rows, param.device_mesh, param.placements, shape=param.shape,
                                                 stride=param.stride())
        options = dataclasses.replace(_options(), strict=not self.skip)
        set_model_state_dict(self.view, state, options=options)


class OptimizerState(Stateful):
    """The optimizer's DCP state, keyed by the same names as the model's."""

    def __init__(self, view: nn.Module, optimizer: torch.optim.Optimizer):
        self.view, self.optimizer = view, optimizer

    def state_dict(self) -> dict:
        return get_optimizer_state_dict(self.view, self.optimizer, options=_options())

    def load_state_dict(self, state: dict) -> None:
        set_optimizer_state_dict(self.view, self.optimizer, state, options=_options())


def app_state(model: nn.Module, optimizer: torch.optim.Optimizer, parts: Sequence[str] = ("model", "optim"),
              skip: frozenset[str] = frozenset(), nf4_source: bool = True) -> dict:
    """The DCP-saved state (see module doc): the selected parts of {"model", "optim"}, as Stateful objects."""
    view = named_view(model)
    state: dict[str, Stateful] = {}
    if "model" in parts:
        state["model"] = ModelState(view, skip, nf4_source)
    if "optim" in parts and not is_zero1(optimizer):
        state["optim"] = OptimizerState(view, optimizer)
    return state


def rank_state(optimizer: torch.optim.Optimizer) -> dict:
    """This rank's private state: RNG streams, and zero1's optimizer shard."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    if is_zero1(optimizer):
        state["zero1_shard"] = optimizer.optim.state_dict()
    return state


def apply_rank_state(state: dict | None, optimizer: torch.optim.Optimizer, load_optim: bool) -> None:
    """Restore RNG streams (when saved by this rank of the same world) and zero1's shard."""
    zero1 = is_zero1(optimizer)
    if state is None:
        if zero1 and load_optim:
            raise WorkerConfigError(
                "checkpoint: zero1 optimizer shards are per rank and were saved with another world size; "
                "resume with the same world size, or set checkpoint.load_only=model"
            )
        return
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if zero1 and load_optim:
        optimizer.optim.load_state_dict(state["zero1_shard"])


@dataclass
class TrainProgress(Stateful):
    """How far the run is: steps done, the data position, the first eval loss, the last step's numbers."""

    seq_len: int
    wandb_id: str | None = None  # this run's W&B id (recorded; a loaded checkpoint's own is not taken over)
    step: int = 0
    samples_seen: int = 0
    initial_val_loss: float = math.nan
    train_loss: float | None = None  # the last step's agreed loss and norm: the summary of a run restarted
    grad_norm: float | None = None  # after its last step

    def advance(self, step: int, loss: float, grad_norm: float, samples_seen: int) -> None:
        """Record a finished step (1-based, as logged) and the first sample of the next one."""
        self.step, self.train_loss, self.grad_norm, self.samples_seen = step, loss, grad_norm, samples_seen

    def state_dict(self) -> dict:
        return {"step": self.step, "samples_seen": self.samples_seen, "tokens_seen": self.samples_seen * self.seq_len,
                "wandb_id": self.wandb_id, "initial_val_loss": self.initial_val_loss,
                "train_loss": self.train_loss, "grad_norm": self.grad_norm}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.samples_seen = state["step"], state["samples_seen"]
        self.initial_val_loss = state.get("initial_val_loss", math.nan)
        self.train_loss, self.grad_norm = state.get("train_loss"), state.get("grad_norm")


class CheckpointMeta(Stateful):
    """meta.json: the progress, the loss scaler and the guard (each Stateful), and the layout saved with."""

    def __init__(self, progress: TrainProgress, scaler: Stateful, guard: Stateful, layout: dict):
        self.progress, self.scaler, self.guard, self.layout = progress, scaler, guard, layout

    def state_dict(self) -> dict:
        progress = self.progress.state_dict()
        head = {key: progress.pop(key) for key in ("step", "samples_seen", "tokens_seen")}
        # The keys in the order earlier versions wrote them.
        return {**head, **self.layout, "wandb_id": progress.pop("wandb_id"), "scaler": self.scaler.state_dict(),
                "guard": self.guard.state_dict(), **progress}

    def load_state_dict(self, state: dict) -> None:
        self.progress.load_state_dict(state)
        self.scaler.load_state_dict(state["scaler"])
        self.guard.load_state_dict(state["guard"])


# torchao's quantized optimizer states (optim=adamw8bit, adamw4bit, adamwfp8): module -> class.
_QUANTIZED_STATES = {"torchao.optim.subclass_8bit": "OptimState8bit", "torchao.optim.subclass_4bit": "OptimState4bit",
                     "torchao.optim.subclass_fp8": "OptimStateFp8"}


def quantized_state_classes() -> list[type]:
    """The quantized optimizer state classes already imported (never imported here). DCP reads tensors weights-only;
    torchao allows its classes when first imported, but a library's load that clears the safe globals (accelerate's)
    takes them away in a long process, and the resume of a low-bit run would fail."""
    return [getattr(sys.modules[name], cls) for name, cls in _QUANTIZED_STATES.items() if name in sys.modules]
