"""Activation checkpointing, compile, W&B offline, and refusing what the worker does not implement."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from worker_runs import base_config, run_worker, series, train_and_check, train_many, write_run_dir

from tests.helpers import assert_curve_close
from trainctl.config.schema import LoggingConfig, ShardingConfig, WandbConfig

pytestmark = pytest.mark.dist

STEPS = 5


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("features")


@pytest.fixture(scope="module")
def runs(root, data_cache):
    """The reference and the W&B run in one interpreter (the W&B run last: nothing runs after its wandb session in
    that process), the 2-rank run in its torchrun (tests/dist/worker_runs.train_many)."""
    full_ac = replace(base_config(data_cache, steps=STEPS, activation_checkpointing="full"),
                      logging=LoggingConfig(log_every=1, progress=False,
                                            wandb=WandbConfig(mode="offline", project="trainctl-test")))
    selective = base_config(data_cache, steps=STEPS, micro_batch=4, activation_checkpointing="selective", ac_every=2)
    return train_many(root, {"reference": (base_config(data_cache, steps=STEPS), None),
                             "full-ac-wandb": (full_ac, None),
                             "selective-ac-fsdp": (replace(selective, sharding=ShardingConfig(strategy="fsdp",
                                                                                              dp_shard=2)), 2)})


@pytest.fixture(scope="module")
def reference(runs):
    return runs["reference"]


@pytest.fixture(scope="module")
def full_ac_with_wandb(runs):
    return runs["full-ac-wandb"]


@pytest.fixture(scope="module")
def selective_ac_fsdp(runs):
    return runs["selective-ac-fsdp"]


@pytest.mark.parametrize("key", ["loss", "grad_norm"])
def test_full_checkpointing_matches_no_checkpointing(reference, full_ac_with_wandb, key):
    assert_curve_close(series(full_ac_with_wandb, key), series(reference, key), key)


@pytest.mark.parametrize("key", ["loss", "grad_norm"])
def test_selective_checkpointing_under_fsdp_matches(reference, selective_ac_fsdp, key):
    assert_curve_close(series(selective_ac_fsdp, key), series(reference, key), key)


def test_wandb_offline_writes_under_run_dir(full_ac_with_wandb):
    offline_runs = list((full_ac_with_wandb / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 1, list((full_ac_with_wandb / "wandb").iterdir())
    (history,) = offline_runs[0].glob("run-*.wandb")
    # The offline history is protobuf records; the logged keys and the run name are stored as plain strings.
    data = history.read_bytes()
    # Namespaced as in TensorBoard (trainctl/train/observe/scalars.py).
    for needle in (b"train/grad_norm", b"perf/tokens_per_s", b"eval/loss", full_ac_with_wandb.name.encode()):
        assert needle in data, needle


def test_wandb_run_id_is_kept_for_restarts(full_ac_with_wandb):
    # A restart or requeue reads RUN_DIR/wandb_id and logs to the same W&B run; checkpoints record it too.
    run_id = (full_ac_with_wandb / "wandb_id").read_text().strip()
    (history,) = (full_ac_with_wandb / "wandb").glob("offline-run-*/run-*.wandb")
    assert history.name == f"run-{run_id}.wandb"
    (final,) = (full_ac_with_wandb / "checkpoints").glob("step-*")
    assert json.loads((final / "meta.json").read_text())["wandb_id"] == run_id


def test_compile_smoke(root, data_cache, reference):
    # Its own process: Dynamo's and Inductor's caches and settings are process-wide, and a smoke test of compile
    # should not lean on (or leave) state from the eager runs.
    cfg = replace(base_config(data_cache, steps=STEPS, compile=True), name="compiled")
    run_dir = train_and_check(root, cfg, None)
    # Inductor fuses and orders the same sums differently from eager: rounding's bound, not bitwise.
    assert_curve_close(series(run_dir, "loss"), series(reference, "loss"), "loss")


def test_unsupported_option_fails_with_one_line_naming_the_key(root, data_cache):
    # Its own start of the ranks: the failing exit and the one error line are the point.
    # Context parallelism needs CUDA: the worker re-checks the device (validate refuses it first; this run dir is hand-written).
    cfg = replace(base_config(data_cache, steps=STEPS), name="cp2", sharding=ShardingConfig(strategy="none", cp=2))
    run_dir = write_run_dir(root, cfg)
    proc = run_worker(run_dir, 2)
    assert proc.returncode != 0
    message = "sharding.cp=2: context parallelism needs CUDA attention kernels"
    assert message in proc.stderr
    log = (run_dir / "logs" / "rank0.log").read_text()
    error_lines = [line for line in log.splitlines() if " ERROR " in line]
    assert len(error_lines) == 1 and message in error_lines[0]
    assert "Traceback" not in log
    assert not (run_dir / "result.json").exists()
