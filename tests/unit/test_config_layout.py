"""Validation of the parallel layout and the batch math: degrees inferred against the world size, the batch
terms derived, and the pipeline, precision and context-parallel rules (config/layout_check.py, config/batch.py).
"""

from __future__ import annotations

import dataclasses

import pytest

from trainctl.config import schema
from trainctl.config.batch import resolve_batch
from trainctl.config.compose import compose
from trainctl.config.errors import ConfigError
from trainctl.config.layout_check import infer_dims
from trainctl.config.validate import resolve


def _problems(overrides):
    with pytest.raises(ConfigError) as info:
        resolve(compose(overrides))
    return info.value.problems


@pytest.mark.parametrize(
    ("global_batch", "micro", "accum", "dp", "expected"),
    [
        (-1, 4, 2, 2, (16, 4, 2)),
        (64, 4, -1, 2, (64, 4, 8)),
        (64, -1, 2, 4, (64, 8, 2)),
        (16, 2, 4, 2, (16, 2, 4)),
    ],
)
def test_batch_math_derives_the_missing_term(global_batch, micro, accum, dp, expected):
    t = dataclasses.replace(schema.TrainConfig(), global_batch=global_batch, micro_batch=micro, grad_accum=accum)
    resolved, problems = resolve_batch(t, dp)
    assert problems == []
    assert (resolved.global_batch, resolved.micro_batch, resolved.grad_accum) == expected


@pytest.mark.parametrize(
    ("global_batch", "micro", "accum", "dp", "fragment"),
    [
        (10, 4, -1, 2, "multiple of 8"),
        (16, 2, 2, 2, "= 8"),
        (-1, -1, 2, 2, "set all but one"),
        (0, 1, 1, 1, "positive"),
    ],
)
def test_batch_math_errors(global_batch, micro, accum, dp, fragment):
    t = dataclasses.replace(schema.TrainConfig(), global_batch=global_batch, micro_batch=micro, grad_accum=accum)
    _, problems = resolve_batch(t, dp)
    assert problems and fragment in problems[0]


def test_topology_infers_one_degree():
    s = dataclasses.replace(schema.ShardingConfig(), strategy="fsdp", dp_shard=-1, tp=8, pp=4)
    dims, problems = infer_dims(s, 128)
    assert problems == []
    assert (dims.dp_shard, dims.tp, dims.pp, dims.dp) == (4, 8, 4, 4)


def test_topology_rejects_mismatch():
    s = dataclasses.replace(schema.ShardingConfig(), strategy="ddp", dp_replicate=2, tp=2)
    dims, problems = infer_dims(s, 8)
    assert dims is None and "multiply to 4" in problems[0]


def test_topology_rejects_indivisible_world():
    s = dataclasses.replace(schema.ShardingConfig(), strategy="fsdp", dp_shard=-1, tp=4)
    _, problems = infer_dims(s, 6)
    assert "not divisible" in problems[0]


# (overrides, how the one problem about them starts, a fragment it must also name)
SINGLE_PROBLEMS = [
    (["recipe=llama70b_3d", "sharding.pp_stages_per_rank=1"], "sharding.pp_stages_per_rank=1", "interleaved"),
    (["recipe=tiny_3d_cpu", "train.global_batch=2", "train.micro_batch=1"], "train.grad_accum=1", "sharding.pp=2"),
    (["recipe=tiny_cpu", "sharding.cp=2", "sharding.dp_replicate=1"], "sharding.cp=2", "cluster.device=cpu"),
    (["precision=fp16", "precision.loss_scaling=false"], "precision.loss_scaling=false", "fp16"),
    (["recipe=tiny_3d_cpu", "model.tie_embeddings=true"], "model.tie_embeddings=true", "pipeline"),
    (["recipe=llama2_13b_pp", "train.compile=true"], "train.compile=true", "interleaved_zero_bubble"),
]


@pytest.mark.parametrize(("overrides", "start", "fragment"), SINGLE_PROBLEMS, ids=[p[1] for p in SINGLE_PROBLEMS])
def test_pipeline_precision_and_cp_rules(overrides, start, fragment):
    problems = _problems(overrides)
    assert any(p.startswith(start) and fragment in p for p in problems), problems


def test_pipeline_layer_split_must_cover_the_model():
    problems = _problems(["recipe=tiny_3d_cpu", "sharding.pp_layers=[1,2]"])
    assert any(p.startswith("sharding.pp_layers=[1, 2]") and "n_layers=4" in p for p in problems)
    resolve(compose(["recipe=tiny_3d_cpu", "sharding.pp_layers=[1,3]"]))  # a valid uneven split


@pytest.mark.parametrize("split", ["[0]", "[1,3]", "[5]"])
def test_a_layer_split_without_pipeline_parallelism_must_cover_the_model_too(split):
    # sharding.pp=1 is one stage, and the plan and the worker still split by pp_layers: [0] failed an assert there.
    problems = _problems(["recipe=tiny_cpu", f"sharding.pp_layers={split}"])
    assert any(p.startswith("sharding.pp_layers=") and "needs 1 positive entries" in p for p in problems), problems
    resolve(compose(["recipe=tiny_cpu", "sharding.pp_layers=[4]"]))  # the one stage holds every layer


def test_fp16_with_pipeline_is_supported():
    from trainctl.core.support import unsupported

    cfg = resolve(compose(["recipe=tiny_3d_cpu", "precision=fp16"]))
    assert unsupported(cfg.sharding, cfg.precision) == []
