"""Resume on another world size (issue 26), the sharded layouts: a zero3 run stopped on 2 workers continues on 4
as zero3, as hsdp (2 replicas of 2 shards) and as a pipeline of 2 stages over 2 shards, as if it had never stopped.
One straight/stopped pair serves every case (each resume works on its own copy of the stopped run); the model has
4 blocks so that each pipeline stage holds 2. fp32, gloo on CPU; the helpers are test_resume_world_size.py's."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_resume_world_size import assert_continues, resume_on, straight_and_stopped

from trainctl.config.load import load_run_config

pytestmark = pytest.mark.dist

ZERO3 = ("sharding=zero3", "model.n_layers=4")


@pytest.fixture(scope="module")
def zero3_runs(tmp_path_factory, data_cache):
    root = tmp_path_factory.mktemp("world-zero3")
    straight, stopped = straight_and_stopped(root, f"data.cache_dir={data_cache}", *ZERO3)
    return root, straight, stopped


def fork(root: Path, stopped: Path, name: str) -> None:
    """A copy of the stopped run (and of its sample probe) to resume under `name`, leaving the original for others."""
    shutil.copytree(stopped, root / "runs" / name)
    shutil.copytree(root / "stopped-samples", root / f"{name}-samples")


# (overrides of the resume, the 4-worker split it resolves to: dp_replicate, dp_shard, pp, micro_batch, grad_accum).
# The global batch stays 8: zero3 and hsdp as 2 micro x 1 accum x 4 dp ranks; the pipeline as 2 micro x 2 accum
# x 2 dp ranks (its 1f1b schedule needs at least pp=2 microbatches per step).
LAYOUTS = {
    "zero3x4": ((), (1, 4, 1, 2, 1)),
    "hsdp2x2": (("sharding.strategy=hsdp", "sharding.dp_shard=2"), (2, 2, 1, 2, 1)),
    "pp2-zero3x2": (("sharding.pp=2",), (1, 2, 2, 2, 2)),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_zero3_run_stopped_on_2_workers_resumes_on_4_as_if_it_never_stopped(zero3_runs, name):
    root, straight, stopped = zero3_runs
    overrides, split = LAYOUTS[name]
    fork(root, stopped, name)
    resumed = resume_on(root, name, 4, *overrides)
    cfg = load_run_config(resumed)
    s, t = cfg.sharding, cfg.train
    assert (s.dp_replicate, s.dp_shard, s.pp, t.micro_batch, t.grad_accum) == split
    assert "resharded" in (resumed / "logs" / "rank0.log").read_text()
    assert_continues(resumed, straight, root)


def test_a_pipeline_run_stopped_on_2_workers_resumes_on_1_without_a_pipeline(tmp_path, data_cache):
    """pp=2 (a stage of 2 blocks per worker, 4 micro x 2 accum for its 1f1b schedule) to one worker holding all
    4 blocks: DCP joins the stages' model and optimizer states; the batch split stays 4 x 2 x 1."""
    straight, stopped = straight_and_stopped(tmp_path, f"data.cache_dir={data_cache}", "sharding.pp=2",
                                             "model.n_layers=4")
    assert load_run_config(stopped).sharding.pp == 2
    resumed = resume_on(tmp_path, "stopped", 1, "sharding.pp=1")
    cfg = load_run_config(resumed)
    assert (cfg.sharding.pp, cfg.train.micro_batch, cfg.train.grad_accum) == (1, 4, 2)
    assert_continues(resumed, straight, tmp_path)
