"""Data parallelism and accumulation change nothing in fp32: same losses and grad norms as one big batch."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from worker_runs import base_config, records, series, train_many

from tests.helpers import assert_curve_close, curve_rel
from trainctl.config.schema import MoEConfig, ShardingConfig

pytestmark = [pytest.mark.dist, pytest.mark.parity]

PARITY_STEPS = 10
# A tiny Mixtral (4 experts, 2 per token, aux loss on): its curve under FSDP2 equals one process's.
MOE = MoEConfig(num_experts=4, experts_per_token=2, expert_ffn_dim=64, router="topk_softmax", aux_loss_coef=0.01)


def moe_config(cfg):
    return replace(cfg, model=replace(cfg.model, family="mixtral", ffn_dim=64, moe=MOE))


def assert_same_curve(run_dir, reference, key: str, steps: int = PARITY_STEPS) -> None:
    got, want = series(run_dir, key)[:steps], series(reference, key)[:steps]
    assert len(got) == len(want) == steps
    assert_curve_close(got, want, key)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    """One process on the whole batch, and the same global batch of 8 split four other ways."""
    root = tmp_path_factory.mktemp("parity")
    fsdp = ShardingConfig(strategy="fsdp", dp_shard=2)
    configs = {
        # Plain `python -m trainctl.train`: the world-of-one path without torchrun.
        "single": (base_config(data_cache, micro_batch=8, grad_accum=1), None),
        "accum4": (base_config(data_cache, micro_batch=2, grad_accum=4), 1),
        "ddp": (base_config(data_cache, micro_batch=2, grad_accum=2), 2),
        "fsdp": (base_config(data_cache, micro_batch=4, grad_accum=1), 2),
        "zero2": (base_config(data_cache, micro_batch=2, grad_accum=2), 2),
        "hsdp": (base_config(data_cache, micro_batch=4, grad_accum=1), 2),
        "hsdp2x2": (base_config(data_cache, micro_batch=2, grad_accum=1), 4),
        # The aux loss is a mean over each micro-batch's tokens (Switch's, not linear in them): both split the
        # global batch into the same micro-batches of 2, one process accumulating 4, each of 2 ranks 2.
        "moe_single": (moe_config(base_config(data_cache, micro_batch=2, grad_accum=4)), None),
        # In the 2-rank torchrun above: accumulation and FSDP2's reduce-scatter around the aux loss.
        "moe_fsdp": (moe_config(base_config(data_cache, micro_batch=2, grad_accum=2)), 2),
    }
    sharding = {
        "ddp": ShardingConfig(strategy="ddp", dp_replicate=2),
        "fsdp": fsdp,
        "moe_fsdp": fsdp,
        "zero2": ShardingConfig(strategy="zero2", dp_shard=2),
        # A 2-D (replicate 2 x shard 1) mesh: the HSDP code path on two ranks.
        "hsdp": ShardingConfig(strategy="hsdp", dp_replicate=2, dp_shard=1),
        # The real HSDP layout: shard within groups of 2, replicate across 2 groups (4 ranks).
        "hsdp2x2": ShardingConfig(strategy="hsdp", dp_replicate=2, dp_shard=2),
    }
    return train_many(root, {name: (replace(cfg, sharding=sharding.get(name, cfg.sharding)), nproc)
                             for name, (cfg, nproc) in configs.items()})


@pytest.mark.parametrize("name", ["ddp", "fsdp", "zero2", "hsdp", "hsdp2x2"])
@pytest.mark.parametrize("key", ["loss", "grad_norm"])
def test_data_parallel_matches_one_process(runs, name, key):
    assert_same_curve(runs[name], runs["single"], key)


@pytest.mark.parametrize("key", ["loss", "grad_norm", "aux_loss"])
def test_a_mixture_of_experts_under_fsdp2_matches_one_process(runs, key):
    assert_same_curve(runs["moe_fsdp"], runs["moe_single"], key)
    if key == "loss":  # every rank's routed tokens are counted: the whole global batch, k slots each
        loads = [r["expert_load"] for r in records(runs["moe_fsdp"], "train")]
        assert all(sum(layer) == 8 * 64 * MOE.experts_per_token for step in loads for layer in step)


@pytest.mark.parametrize("key", ["loss", "grad_norm"])
def test_accumulating_4_micro_batches_matches_one_4x_batch(runs, key):
    assert_same_curve(runs["accum4"], runs["single"], key)


def test_eval_loss_matches_across_layouts(runs):
    # Same held-out set (dp x eval_batches x micro_batch samples) only where those products match.
    for name in ("fsdp", "hsdp"):
        want = records(runs["single"], "eval")[0]["val_loss"]
        assert records(runs[name], "eval")[0]["val_loss"] == pytest.approx(want, rel=curve_rel(0)), name


def test_the_steps_actually_differ(runs):
    # Guards the parity tests against a degenerate run that repeats one number.
    losses = series(runs["single"], "loss")
    assert len(set(losses)) == len(losses)


def test_loss_goes_down(runs):
    losses = series(runs["ddp"], "loss")
    assert len(losses) == 30
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.3, (first, last)
    result = records(runs["ddp"], "final")[0]
    assert result["final_val_loss"] < result["initial_val_loss"] - 0.3


def test_run_dir_is_complete(runs):
    run_dir = runs["ddp"]
    for rank in (0, 1):
        log = (run_dir / "logs" / f"rank{rank}.log").read_text()
        assert f"rank{rank} INFO" in log and "final step" in log
    train = records(run_dir, "train")
    assert [r["step"] for r in train] == list(range(1, 31))
    for record in train:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "tokens_seen"} <= record.keys()
        assert record["tokens_seen"] == record["step"] * 8 * 64
        assert "mfu" not in record  # no known peak on CPU
    assert [r["step"] for r in records(run_dir, "eval")] == [0, 30]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["steps"] == 30
    # The same floats written to two files (JSON keeps a float exactly): equal, not close.
    assert result["final_train_loss"] == train[-1]["loss"]
    assert result["final_val_loss"] == records(run_dir, "eval")[-1]["val_loss"]
    assert result["wall_time_s"] > 0
