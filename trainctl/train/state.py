"""What a checkpoint holds, and how it maps onto the live job.

DCP part (resharded on load, so a checkpoint loads into another world size or layout):
  model   torch's get_model_state_dict over the model's pieces, under the full model's names
          (layers.3.attention.wq.weight): wrappers (DDP, compile, checkpointing) and the pipeline
          split leave no trace in the names.
  optim   get_optimizer_state_dict, keyed by the same names (AdamW moments and step counts).
Per rank (rank_state): RNG states of python, numpy, torch CPU and CUDA; zero1's optimizer shard
  (ZeroRedundancyOptimizer partitions whole tensors by rank, so its shards do not reshard).
meta.json: step, samples and tokens seen, the layout it was saved with, the W&B run id, the
  loss-scaler and guard state, the first eval loss. The LR schedule is a function of the step.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

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
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from trainctl.train.errors import WorkerConfigError


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


def app_state(model: nn.Module, optimizer: torch.optim.Optimizer, parts: Sequence[str] = ("model", "optim")) -> dict:
    """The DCP-saved state (see module doc): the selected parts of {"model", "optim"}."""
    view = named_view(model)
    state = {}
    if "model" in parts:
        state["model"] = get_model_state_dict(view, options=_options())
    if "optim" in parts and not isinstance(optimizer, ZeroRedundancyOptimizer):
        state["optim"] = get_optimizer_state_dict(view, optimizer, options=_options())
    return state


def apply_app_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Put loaded DCP state back into the live model and optimizer."""
    view = named_view(model)
    if "model" in state:
        set_model_state_dict(view, state["model"], options=_options())
    if "optim" in state:
        set_optimizer_state_dict(view, optimizer, state["optim"], options=_options())


def rank_state(optimizer: torch.optim.Optimizer) -> dict:
    """This rank's private state: RNG streams, and zero1's optimizer shard."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        state["zero1_shard"] = optimizer.optim.state_dict()
    return state


def apply_rank_state(state: dict | None, optimizer: torch.optim.Optimizer, load_optim: bool) -> None:
    """Restore RNG streams (when saved by this rank of the same world) and zero1's shard."""
    zero1 = isinstance(optimizer, ZeroRedundancyOptimizer)
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
