"""core.wrapping's decision, pinned as a table: the worker and the plan both read it, so a change shows here.

tests/dist/test_wrapping.py checks the worker's actual modules against the decision; this file checks the
decision itself against what the worker is documented to do (core/wrapping.py's module doc).
"""

from __future__ import annotations

import pytest

from trainctl.config.schema import PrecisionConfig
from trainctl.core.dims import ParallelDims
from trainctl.core.wrapping import canonical, shards_parameters, wrapping

R, S = "dp_replicate", "dp_shard"
# strategy, model parallel (tp or pp > 1) -> fsdp, fsdp_as_ddp, ddp, zero1, reshard_after_forward, dp_mesh
TABLE = {
    ("none", False): (False, False, False, False, False, ()),
    ("none", True): (False, False, False, False, False, ()),
    ("ddp", False): (False, False, True, False, False, (R,)),
    ("ddp", True): (False, True, False, False, False, (R, S)),
    ("zero1", False): (False, False, True, True, False, (R,)),
    ("zero2", False): (True, False, False, False, False, (S,)),
    ("zero2", True): (True, False, False, False, False, (S,)),
    ("zero3", False): (True, False, False, False, True, (S,)),
    ("zero3", True): (True, False, False, False, True, (S,)),
    ("fsdp", True): (True, False, False, False, True, (S,)),
    ("hsdp", False): (True, False, False, False, True, (R, S)),
    ("hsdp", True): (True, False, False, False, True, (R, S)),
}


@pytest.mark.parametrize(("strategy", "model_parallel"), list(TABLE))
def test_the_wrapper_of_each_strategy(strategy, model_parallel):
    dims = ParallelDims(tp=2) if model_parallel else ParallelDims()
    w = wrapping(strategy, dims, PrecisionConfig())
    decided = (w.fsdp, w.fsdp_as_ddp, w.ddp, w.zero1, w.reshard_after_forward, w.dp_mesh)
    assert decided == TABLE[strategy, model_parallel]
    assert wrapping(strategy, ParallelDims(pp=2) if model_parallel else dims) == w  # pp counts as tp does


@pytest.mark.parametrize("strategy", ["none", "ddp", "zero1", "zero2", "zero3", "hsdp"])
@pytest.mark.parametrize("compute", ["fp32", "bf16", "fp16"])
def test_precision_by_fsdp_policy_or_by_autocast(strategy, compute):
    w = wrapping(strategy, ParallelDims(), PrecisionConfig(compute_dtype=compute, reduce_dtype="fp32"))
    fsdp_lower = w.fsdp and compute != "fp32"
    assert (w.param_dtype, w.reduce_dtype) == ((compute, "fp32") if fsdp_lower else (None, None))
    assert w.autocast == (compute != "fp32" and not w.fsdp)


def test_ddp_over_tp_keeps_fp32_parameters_and_uses_autocast():
    w = wrapping("ddp", ParallelDims(tp=2), PrecisionConfig(compute_dtype="bf16"))
    assert w.fsdp_as_ddp and w.param_dtype is None and w.autocast


@pytest.mark.parametrize(("strategy", "recipe", "gathers"), [
    ("zero3", "tensorwise", True), ("zero3", "rowwise", False), ("ddp", "tensorwise", False),
])
def test_float8_all_gather_needs_fsdp_and_the_tensorwise_recipe(strategy, recipe, gathers):
    precision = PrecisionConfig(compute_dtype="bf16", fp8=True, fp8_recipe=recipe)
    assert wrapping(strategy, ParallelDims(), precision).float8_all_gather == gathers


def test_the_alias_is_resolved_to_what_it_names():
    assert canonical("fsdp") == "zero3" and canonical("zero2") == "zero2"
    assert shards_parameters("fsdp") and not shards_parameters("zero1")
