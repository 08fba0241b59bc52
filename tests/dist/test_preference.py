"""DPO under FSDP2 on two ranks trains the same curve as one process: each pair stays on one rank, the frozen
reference is sharded as the policy, and the loss, gradient norm, pair metrics and eval agree to rounding."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from worker_runs import TINY, assert_same_evals, assert_same_steps, base_config, records, train_and_check

from tests.helpers import rounding_rel
from tests.unit.test_preference_loss import preference_set
from trainctl.config.schema import DataConfig, ShardingConfig

pytestmark = [pytest.mark.dist]

STEPS = 5
# The step's shape for the rounding bound: 8 pairs are 16 sequences, and the reference adds a forward.
SHAPE = {"model": TINY, "batch": 2 * 8 * 2}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    root = tmp_path_factory.mktemp("preference")
    data = DataConfig(kind="memmap", datasets=[str(preference_set(root))], vocab_size=256)
    base = base_config(data_cache, steps=STEPS, micro_batch=4, grad_accum=2, eval_every=STEPS, eval_batches=4,
                       objective="dpo", dpo_beta=0.5)
    base = replace(base, data=data)
    single = train_and_check(root, replace(base, name="single"), None)
    train = replace(base.train, grad_accum=1, eval_batches=2)  # the same 8 pairs a step, 16 held out
    fsdp = replace(base, name="fsdp2", train=train, sharding=ShardingConfig(strategy="fsdp", dp_shard=2))
    return single, train_and_check(root, fsdp, 2)


@pytest.mark.parametrize("key", ["loss", "grad_norm", "reward_margin", "logp_chosen"])
def test_dpo_under_fsdp2_matches_one_process(runs, key):
    single, fsdp = runs
    assert_same_steps(fsdp, single, key, STEPS, **SHAPE)
    assert [r["reward_accuracy"] for r in records(fsdp, "train")] == [r["reward_accuracy"] for r in
                                                                     records(single, "train")]


def test_dpo_eval_matches_and_starts_at_log_2(runs):
    single, fsdp = runs
    assert_same_evals(fsdp, single, **SHAPE)
    first = records(single, "eval")[0]
    # The policy is the reference: every h is 0, the loss log 2 (a log-sigmoid and a mean, in fp32).
    assert first["step"] == 0 and abs(first["val_loss"] - math.log(2)) <= rounding_rel(torch.float32, 4) * math.log(2)
