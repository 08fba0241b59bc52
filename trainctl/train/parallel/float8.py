"""torchao float8 training: eligible nn.Linear layers become Float8Linear, on top of bf16.

torchao is an optional dependency (`pip install 'trainctl[fp8]'`), imported only when
`precision.fp8` is on. Conversion runs on the meta-device model before tensor parallelism
(TP then shards each Float8Linear, with torchao's float8 styles for the tensorwise recipe) and
before activation checkpointing, compile and FSDP2 (which wrap or shard the converted modules).

A Linear stays in bf16 when its name contains one of `precision.fp8_exclude` (the output
layer is sensitive to fp8 rounding), when its in/out features are not multiples of 16
(the fp8 matmul kernels need that alignment), and under `precision.fp8_filter=auto` (the default) when
torchao's size rule says float8 would not gain at its shape (core/float8.py).

Under FSDP2 with the tensorwise recipe the gathered weights travel in float8 (half the
all-gather bytes of bf16): torchao's `enable_fsdp_float8_all_gather`. Their scales are then
computed for all layers at once after each optimizer step (`precompute_float8_dynamic_scale_for_fsdp`,
registered as an optimizer step post-hook: it does not run on a skipped step, when the
weights did not change).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from types import ModuleType

import torch
from torch import nn

from trainctl.config.schema import PrecisionConfig
from trainctl.core.float8 import ROWWISE_RECIPES, converts
from trainctl.core.wrapping import float8_all_gather
from trainctl.train.errors import WorkerConfigError

log = logging.getLogger("trainctl.train")

def import_torchao_float8() -> ModuleType:
    """torchao.float8, or a one-line error naming the key and the install command."""
    try:
        import torchao.float8 as float8
    except ImportError as err:
        raise WorkerConfigError("precision.fp8=true needs torchao: pip install 'trainctl[fp8]'") from err
    return float8


def wants_float8(module: nn.Module, fqn: str, precision: PrecisionConfig) -> bool:
    """True for a Linear float8 converts (core/float8.converts: name excludes, alignment, fp8_filter)."""
    if not isinstance(module, nn.Linear):
        return False
    return converts(precision.fp8_filter, precision.fp8_recipe, fqn, module.out_features, module.in_features,
                    precision.fp8_exclude)


def module_filter(float8: ModuleType, precision: PrecisionConfig) -> Callable[[nn.Module, str], bool]:
    """fp8_filter=auto: torchao's own `_auto_filter_for_recipe` where this torchao has it for the recipe (it
    excludes by name and alignment as well); otherwise, and for fp8_filter=all, core's rule."""
    auto = getattr(float8, "_auto_filter_for_recipe", None)
    if precision.fp8_filter == "auto" and auto is not None:
        try:
            return auto(precision.fp8_recipe, list(precision.fp8_exclude))
        except (NotImplementedError, ValueError):
            pass  # rowwise_with_gw_hp: torchao's rule leaves it out; core's gives it rowwise's thresholds
    return lambda module, fqn: wants_float8(module, fqn, precision)


def emulate_rowwise_casts(precision: PrecisionConfig) -> None:
    """Rowwise recipes: Inductor emulates the eager casts' rounding (as torchtitan sets it), so compiled and eager
    float8 runs round alike; without it Inductor may fuse the bf16 -> fp8 cast without the intermediate rounding."""
    if precision.fp8_recipe in ROWWISE_RECIPES:
        import torch._inductor.config as inductor_config

        inductor_config.emulate_precision_casts = True


def apply_float8(model: nn.Module, precision: PrecisionConfig, fsdp: bool) -> int:
    """Swap the Linears fp8_filter picks for torchao Float8Linear in place; returns how many were converted."""
    if not precision.fp8:
        return 0
    float8 = import_torchao_float8()
    config = float8.Float8LinearConfig.from_recipe_name(precision.fp8_recipe)
    if float8_all_gather(fsdp, precision):
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    emulate_rowwise_casts(precision)
    float8.convert_to_float8_training(model, config=config, module_filter_fn=module_filter(float8, precision))
    converted = count_float8_linears(model)
    linears = converted + sum(isinstance(m, nn.Linear) and not is_float8_linear(m) for m in model.modules())
    log.info("float8: %d of %d Linear layers converted (recipe %s, filter %s, fsdp float8 all-gather %s)",
             converted, linears, precision.fp8_recipe, precision.fp8_filter, config.enable_fsdp_float8_all_gather)
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
