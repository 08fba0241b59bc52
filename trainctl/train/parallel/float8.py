"""torchao float8 training: eligible nn.Linear layers become Float8Linear, on top of bf16.

torchao is an optional dependency (`pip install 'trainctl[fp8]'`), imported only when
`precision.fp8` is on. Conversion runs on the meta-device model before tensor parallelism
(TP then shards each Float8Linear, with torchao's float8 styles for the tensorwise recipe) and
before activation checkpointing, compile and FSDP2 (which wrap or shard the converted modules).

A Linear stays in bf16 when its name contains one of `precision.fp8_exclude` (the output
layer is sensitive to fp8 rounding) or when its in/out features are not multiples of 16
(the fp8 matmul kernels need that alignment).

Under FSDP2 with the tensorwise recipe the gathered weights travel in float8 (half the
all-gather bytes of bf16): torchao's `enable_fsdp_float8_all_gather`. Their scales are then
computed for all layers at once after each optimizer step (`precompute_float8_dynamic_scale_for_fsdp`,
registered as an optimizer step post-hook: it does not run on a skipped step, when the
weights did not change).
"""

from __future__ import annotations

import dataclasses
import logging
from types import ModuleType

import torch
from torch import nn

from trainctl.config.schema import PrecisionConfig
from trainctl.core.wrapping import float8_all_gather
from trainctl.train.errors import WorkerConfigError

log = logging.getLogger("trainctl.train")

FP8_ALIGNMENT = 16


def import_torchao_float8() -> ModuleType:
    """torchao.float8, or a one-line error naming the key and the install command."""
    try:
        import torchao.float8 as float8
    except ImportError as err:
        raise WorkerConfigError("precision.fp8=true needs torchao: pip install 'trainctl[fp8]'") from err
    return float8


def wants_float8(module: nn.Module, fqn: str, exclude: tuple[str, ...]) -> bool:
    """True for a Linear that float8 can run: not excluded by name, both dimensions 16-aligned."""
    if not isinstance(module, nn.Linear):
        return False
    if any(part in fqn for part in exclude):
        return False
    return module.in_features % FP8_ALIGNMENT == 0 and module.out_features % FP8_ALIGNMENT == 0


def apply_float8(model: nn.Module, precision: PrecisionConfig, fsdp: bool) -> int:
    """Swap eligible Linears for torchao Float8Linear in place; returns how many were converted."""
    if not precision.fp8:
        return 0
    float8 = import_torchao_float8()
    config = float8.Float8LinearConfig.from_recipe_name(precision.fp8_recipe)
    if float8_all_gather(fsdp, precision):
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    exclude = tuple(precision.fp8_exclude)
    float8.convert_to_float8_training(
        model, config=config, module_filter_fn=lambda module, fqn: wants_float8(module, fqn, exclude)
    )
    converted = count_float8_linears(model)
    linears = converted + sum(isinstance(m, nn.Linear) and not is_float8_linear(m) for m in model.modules())
    log.info("float8: %d of %d Linear layers converted (recipe %s, fsdp float8 all-gather %s)",
             converted, linears, precision.fp8_recipe, config.enable_fsdp_float8_all_gather)
    return converted


def is_float8_linear(module: nn.Module) -> bool:
    return type(module).__name__ == "Float8Linear"


def count_float8_linears(model: nn.Module) -> int:
    return sum(is_float8_linear(m) for m in model.modules())


def register_float8_scale_precompute(
    optimizer: torch.optim.Optimizer, model: nn.Module, precision: PrecisionConfig, fsdp: bool
) -> None:
    """With float8 all-gather (core.wrapping decides), refresh every layer's weight scale after each optimizer step."""
    if not float8_all_gather(fsdp, precision):
        return
    float8 = import_torchao_float8()
    optimizer.register_step_post_hook(lambda *_: float8.precompute_float8_dynamic_scale_for_fsdp(model))
