"""Which Linear layers float8 converts: one rule for the plan (torch-free) and the worker (torchao).

`precision.fp8_filter`:
  auto  only the Linears torchao's own size rule says gain for the recipe (torchao.float8's
        `_auto_filter_for_recipe`, from its H100 performance tables: a float8 matmul pays only when its
        casts are small next to its FLOPs); the worker calls torchao's function where the installed
        torchao has it, and tests/unit/test_float8_filter.py keeps this copy equal to it
  all   every Linear whose dimensions are both multiples of 16 (the float8 kernels' alignment)
Either way a Linear whose name contains one of `precision.fp8_exclude` stays in the compute dtype.
A Linear's weight is [out_features (N), in_features (K)], as torchao reads it.
"""

from __future__ import annotations

FP8_ALIGNMENT = 16
FP8_FILTERS = ("auto", "all")
# Recipes whose casts are per row (Inductor must emulate the casts' rounding to match eager: see train/float8).
ROWWISE_RECIPES = ("rowwise", "rowwise_with_gw_hp")


def aligned(out_features: int, in_features: int) -> bool:
    return out_features % FP8_ALIGNMENT == 0 and in_features % FP8_ALIGNMENT == 0


def gains(recipe: str, out_features: int, in_features: int) -> bool:
    """torchao's size rule: whether a float8 matmul of this shape beats bf16 under `recipe` (rowwise_with_gw_hp,
    which torchao's rule leaves out, takes rowwise's thresholds: its forward and input gradient are rowwise)."""
    n, k = out_features, in_features
    if recipe in ROWWISE_RECIPES:
        return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))
    return not (k <= 4096 and n <= 1024)


def converts(fp8_filter: str, recipe: str, fqn: str, out_features: int, in_features: int,
             exclude: list[str] | tuple[str, ...]) -> bool:
    """Whether float8 converts the Linear named `fqn` of this shape (module doc)."""
    if any(part in fqn for part in exclude) or not aligned(out_features, in_features):
        return False
    return fp8_filter != "auto" or gains(recipe, out_features, in_features)
