"""Pipeline parallelism changes nothing in fp32: every schedule and split trains like one process.

Activation offload and the NaN guard work under a pipeline too: the schedule step runs under the same
micro-batch context as the plain loop (probed by test-side code, tests/faults).

The reference is one process accumulating the same 4 micro-batches (the same global batch and
the same held-out batches, so the eval losses compare too). Each pipeline run splits a 4-layer
model into stages over 2 ranks; eval_batches=2 < grad_accum=4 also exercises the padded eval group.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from worker_runs import TINY, base_config, records, selected, series, train_and_check, train_many

from tests.faults.worker_faults import fault_env
from tests.helpers import assert_curve_close
from trainctl.config.schema import GuardsConfig, ShardingConfig

pytestmark = pytest.mark.dist

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
def runs(request, tmp_path_factory, data_cache):
    """The one-process reference and every selected layout; the layouts of one world size train in one torchrun."""
    reference = base_config(data_cache, steps=STEPS, micro_batch=2, grad_accum=4)
    cases = {"reference": (replace(reference, model=MODEL), None)}
    cases.update((name, pipeline_config(data_cache, name)) for name in selected(request, "name", LAYOUTS))
    return train_many(tmp_path_factory.mktemp("pipeline"), cases)


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("key", ["loss", "grad_norm"])
def test_pipeline_matches_one_process(runs, name, key):
    got, want = series(runs[name], key), series(runs["reference"], key)
    assert len(got) == len(want) == STEPS
    assert_curve_close(got, want, key)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_pipeline_eval_matches_one_process(runs, name):
    got, want = records(runs[name], "eval"), records(runs["reference"], "eval")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [0, STEPS]
    assert_curve_close([r["val_loss"] for r in got], [r["val_loss"] for r in want], "val_loss", steps=[0, STEPS])


def test_the_steps_actually_differ(runs):
    # Guards the parity tests against a degenerate run that repeats one number.
    losses, norms = series(runs["reference"], "loss"), series(runs["reference"], "grad_norm")
    assert len(set(losses)) == len(losses) and len(set(norms)) == len(norms)



def with_faults(root, cfg, nproc: int, **faults):
    """train_and_check with test-side faults or probes in the workers (tests/faults), in a torchrun of its own: the
    faults reach a process through its environment, so they would act on every run it trains, and the offload
    probe counts for the whole process (it writes its counts at exit)."""
    with pytest.MonkeyPatch.context() as env:
        for name, value in fault_env(**faults).items():
            env.setenv(name, value)
        return train_and_check(root, cfg, nproc)


@pytest.fixture(scope="module")
def offloaded(tmp_path_factory, data_cache):
    """1f1b over 2 stages with train.activation_offload=true; every rank counts its offload hooks' calls."""
    root = tmp_path_factory.mktemp("offload")
    cfg, nproc = pipeline_config(data_cache, "1f1b")
    cfg = replace(cfg, name="offload-1f1b", train=replace(cfg.train, activation_offload=True))
    return with_faults(root, cfg, nproc, offload_probe=str(root)), root


def test_activation_offload_runs_on_every_pipeline_stage(offloaded):
    _, probes = offloaded
    for rank in (0, 1):
        counts = json.loads((probes / f"offload-rank{rank}.json").read_text())
        # Entered once per schedule step (evaluation runs without it); its hooks saw the stage's activations.
        assert counts["entered"] == STEPS and counts["packed"] > 0 and counts["unpacked"] > 0, (rank, counts)


@pytest.mark.parametrize("key", ["loss", "grad_norm"])
def test_activation_offload_under_a_pipeline_matches_one_process(runs, offloaded, key):
    run_dir, _ = offloaded
    assert_curve_close(series(run_dir, key), series(runs["reference"], key), key)


def test_nan_at_a_step_reaches_the_guard_through_the_pipeline(tmp_path, data_cache):
    cfg, nproc = pipeline_config(data_cache, "1f1b")
    cfg = replace(cfg, name="nan-1f1b", guards=GuardsConfig(nonfinite="skip"))
    run_dir = with_faults(tmp_path, cfg, nproc, nan_at_step=4)
    losses = dict(zip([r["step"] for r in records(run_dir, "train")], series(run_dir, "loss"), strict=True))
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[4] != losses[4] and all(v == v for step, v in losses.items() if step != 4)
    result = json.loads((run_dir / "result.json").read_text())
    assert result["guard_skipped_steps"] == 1 and result["steps"] == STEPS
