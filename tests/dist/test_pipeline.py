"""Pipeline parallelism changes nothing in fp32: every schedule and split trains like one process.

The reference is one process accumulating the same 4 micro-batches (the same global batch and
the same held-out batches, so the eval losses compare too). Each pipeline run splits a 4-layer
model into stages over 2 ranks; eval_batches=2 < grad_accum=4 also exercises the padded eval group.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from worker_runs import TINY, base_config, records, run_worker, series, train_and_check, write_run_dir

from trainctl.config.schema import ShardingConfig

pytestmark = pytest.mark.dist

REL = 1e-5
STEPS = 10
MODEL = replace(TINY, n_layers=4)

# name: (pp_schedule, pp_stages_per_rank, pp_layers, strategy, dp degree)
LAYOUTS = {
    "gpipe": ("gpipe", 1, [], "none", 1),
    "1f1b": ("1f1b", 1, [], "none", 1),
    "interleaved_1f1b": ("interleaved_1f1b", 2, [], "none", 1),
    "interleaved_zero_bubble": ("interleaved_zero_bubble", 2, [], "none", 1),
    "uneven_1_3": ("1f1b", 1, [1, 3], "none", 1),
    "fsdp2_x_pp2": ("1f1b", 1, [], "fsdp", 2),
    "ddp2_x_pp2": ("1f1b", 1, [], "ddp", 2),
}


def pipeline_config(data_cache, name: str):
    schedule, per_rank, layers, strategy, dp = LAYOUTS[name]
    # Global batch 8 = micro 2 x accum 4 on one dp rank, micro 2 x accum 2 on each of two; the
    # held-out set is the same 4 samples either way (dp x eval_batches x micro_batch).
    cfg = base_config(data_cache, steps=STEPS, micro_batch=2, grad_accum=4 // dp, eval_batches=2 // dp)
    dp_dims = {"dp_replicate": dp} if strategy == "ddp" else {"dp_shard": dp}
    sharding = ShardingConfig(strategy=strategy, pp=2, pp_schedule=schedule,
                              pp_stages_per_rank=per_rank, pp_layers=layers, **dp_dims)
    return replace(cfg, name=name, model=MODEL, sharding=sharding), 2 * dp


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    root = tmp_path_factory.mktemp("pipeline")
    reference = replace(base_config(data_cache, steps=STEPS, micro_batch=2, grad_accum=4), name="reference", model=MODEL)
    out = {"reference": train_and_check(root, reference, None)}
    for name in LAYOUTS:
        cfg, nproc = pipeline_config(data_cache, name)
        out[name] = train_and_check(root, cfg, nproc)
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("key", ["loss", "grad_norm"])
def test_pipeline_matches_one_process(runs, name, key):
    got, want = series(runs[name], key), series(runs["reference"], key)
    assert len(got) == len(want) == STEPS
    assert got == pytest.approx(want, rel=REL), key


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_pipeline_eval_matches_one_process(runs, name):
    got, want = records(runs[name], "eval"), records(runs["reference"], "eval")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [0, STEPS]
    assert [r["val_loss"] for r in got] == pytest.approx([r["val_loss"] for r in want], rel=REL)


def test_the_steps_actually_differ(runs):
    # Guards the parity tests against a degenerate run that repeats one number.
    losses, norms = series(runs["reference"], "loss"), series(runs["reference"], "grad_norm")
    assert len(set(losses)) == len(losses) and len(set(norms)) == len(norms)

