"""When the worker quantizes QLoRA's base (model.lora.base_dtype=nf4), around the start point's weights.

The base must hold its values first: a fresh run quantizes after the init (or checkpoint.init_from's load). A
checkpoint of a 4-bit run holds NF4 tensors, which DCP reads only into NF4 tensors of the same layout, so the
live base is quantized before such a checkpoint is read; a full-precision checkpoint (a run that starts from a
full or LoRA run's weights) is read first and quantized after.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from torch import nn

from trainctl.config.schema import ModelConfig
from trainctl.core.errors import UserError
from trainctl.models.qlora import base_bytes, is_nf4, quantize_base, saved_nf4
from trainctl.train.errors import WorkerConfigError
from trainctl.train.observe.metrics import print0


def quantize(model: nn.Module, m: ModelConfig, is_main: bool = True, say: bool = True) -> int:
    """The live base in NF4 (once: a no-op when it already is, as under FSDP2, which quantized it before
    sharding); with `say`, says what this rank holds on rank 0."""
    try:
        count = quantize_base(model, m.lora)
    except UserError as exc:  # torchao missing: one line naming the key and the install
        raise WorkerConfigError(str(exc)) from None
    held = sum(1 for p in model.parameters() if is_nf4(p))
    if say and held:
        print0(f"qlora: {held} adapted weights in NF4, {base_bytes(model) / 2**20:.1f} MiB on this rank", is_main)
    return count


def around_restore(model: nn.Module, m: ModelConfig, path: Path, restore: Callable, is_main: bool = True):
    """`restore()` of checkpoint `path` with the live base quantized before or after it (module doc)."""
    before = saved_nf4(path) is not None
    if before and m.lora.base_dtype != "nf4":
        raise WorkerConfigError(f"checkpoint {path}: its base weights are 4-bit (model.lora.base_dtype=nf4), which a "
                                f"run with model.lora.base_dtype={m.lora.base_dtype} cannot read; set "
                                "model.lora.base_dtype=nf4, or start from the run's merged export "
                                "(trainctl export RUN --merged) with checkpoint.init_from")
    if before:
        quantize(model, m, is_main, say=False)
    start = restore()
    quantize(model, m, is_main)  # a no-op when done before
    return start
