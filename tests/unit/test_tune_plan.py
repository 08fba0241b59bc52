"""`trainctl tune`'s enumeration and ranking (trainctl/plan/tune.py): layouts that launch as their overrides say."""

from __future__ import annotations

import pytest

from trainctl import api
from trainctl.plan import tune


@pytest.fixture(scope="module")
def tiny():
    return api.resolved(["recipe=tiny_cpu"])


@pytest.fixture(scope="module")
def big():
    # 8 GPUs of one node: tp up to 8, every ZeRO stage; a 7B model that does not fit every layout.
    return api.resolved(["recipe=llama7b_fsdp", "cluster.nodes=1"])


def test_layouts_are_distinct_and_start_with_the_config(tiny):
    found = tune.layouts(tiny)
    assert found[0].overrides == () and found[0].cfg == tiny
    keys = [tune.layout_key(v.cfg) for v in found]
    assert len(keys) == len(set(keys))
    assert len(found) <= tune.MAX_CANDIDATES


def test_layouts_cover_each_axis(tiny):
    keys = [tune.layout_key(v.cfg) for v in tune.layouts(tiny)]
    assert {k[0] for k in keys} >= {"ddp", "zero1", "zero2", "zero3"}
    assert {k[3] for k in keys} == {1, 2}  # tp within the node's 2 workers
    assert {k[4] for k in keys} == {1, 2}  # pp
    assert {k[7] for k in keys} == {"none", "full", "selective", "op"}
    assert len({k[8] for k in keys}) >= 3  # micro-batches dividing the per-rank samples


def test_every_layout_keeps_the_global_batch_and_the_world(tiny):
    for v in tune.layouts(tiny):
        s, t = v.cfg.sharding, v.cfg.train
        assert s.dp_replicate * s.dp_shard * s.tp * s.pp * s.cp == 2
        assert t.global_batch == tiny.train.global_batch
        assert t.micro_batch * t.grad_accum * s.dp_replicate * s.dp_shard == t.global_batch


def test_overrides_compose_to_the_layout(tiny):
    """What the probe and the pinned recipe launch is the recipe plus the overrides: the same layout."""
    for v in tune.layouts(tiny)[::13]:  # a spread over every axis (composing is ~0.15 s each)
        composed = api.resolved(["recipe=tiny_cpu", *v.overrides])
        assert tune.layout_key(composed) == tune.layout_key(v.cfg), v.overrides


def test_pipeline_layouts_take_their_stages_from_data_parallelism(tiny):
    piped = [v for v in tune.layouts(tiny) if v.cfg.sharding.pp > 1]
    sample = piped[::8]  # composing is ~0.15 s each
    assert piped and {v.cfg.sharding.pp for v in piped} == {2}  # 2 workers: 2 stages at most
    for v in piped:
        keys = [o.split("=", 1)[0] for o in v.overrides]
        assert len(keys) == len(set(keys)), v.overrides  # each key said once
    for v in sample:
        composed = api.resolved(["recipe=tiny_cpu", *v.overrides])
        assert tune.layout_key(composed) == tune.layout_key(v.cfg), v.overrides


def test_rank_keeps_only_fitting_layouts_fastest_first(big):
    ranked = tune.rank(big)
    assert ranked and all(c.verdict in tune.FITTING for c in ranked)
    assert len(ranked) < len(tune.layouts(big))  # some were left out (planning each again would double the cost)
    speeds = [c.predicted_tokens_per_s for c in ranked]
    assert all(speeds) and speeds == sorted(speeds, reverse=True)


def test_a_cpu_has_no_predicted_tokens_per_s_but_a_relative_order(tiny):
    ranked = tune.rank(tiny)
    assert all(c.predicted_tokens_per_s is None for c in ranked)
    relative = [c.relative_speed for c in ranked]
    assert relative == sorted(relative, reverse=True) and relative[0] > relative[-1]
    # full checkpointing re-runs the forward: slower than the same layout without it
    plain = next(c for c in ranked if c.overrides == ())
    full = next(c for c in ranked if c.overrides == ("train.activation_checkpointing=full",))
    assert full.relative_speed < plain.relative_speed and full.peak_bytes < plain.peak_bytes
