"""Masked (chat) data under pipeline and context parallelism: the same losses, gradient norms and eval losses as
one process. The pipeline's last stage and every cp rank divide by the step's counted targets (loss.step_divisor)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_context_parallel import CPU_RING_WORKER
from worker_runs import TINY, assert_same_evals, assert_same_steps, base_config, selected, train_and_check

from tests.unit.test_masked_loss import chat_set
from trainctl.config.schema import DataConfig, ShardingConfig

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS = 6
MODEL = replace(TINY, n_layers=4)
LAYOUTS = {
    # name: (sharding, ranks, micro_batch, grad_accum, worker entry); global batch 8 throughout
    "pp2_1f1b": (ShardingConfig(strategy="none", pp=2, pp_schedule="1f1b"), 2, 2, 4, None),
    "cp2": (ShardingConfig(strategy="fsdp", dp_shard=1, cp=2), 2, 8, 1, CPU_RING_WORKER),
    "fsdp2_cp2": (ShardingConfig(strategy="fsdp", dp_shard=2, cp=2), 4, 4, 1, CPU_RING_WORKER),
}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, data_cache):
    root = tmp_path_factory.mktemp("masked-layouts")
    data = DataConfig(kind="memmap", datasets=[str(chat_set(root, records=200))], vocab_size=256)
    # The held-out set is dp x eval_batches x micro_batch = 8 samples in every layout (the same samples).
    base = base_config(data_cache, steps=STEPS, micro_batch=2, grad_accum=4, eval_every=3, eval_batches=4)
    base = replace(base, model=MODEL, data=data)
    out = {"single": train_and_check(root, replace(base, name="single"), None)}
    for name in selected(request, "name", LAYOUTS):
        sharding, ranks, micro, accum, entry = LAYOUTS[name]
        dp = ranks // (sharding.cp * sharding.pp)
        train = replace(base.train, micro_batch=micro, grad_accum=accum, eval_batches=8 // (micro * dp))
        out[name] = train_and_check(root, replace(base, name=name, sharding=sharding, train=train), ranks, entry)
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("key", ["loss", "grad_norm"])
def test_masked_layout_matches_one_process(runs, name, key):
    assert_same_steps(runs[name], runs["single"], key, STEPS, model=MODEL)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_masked_eval_matches_one_process(runs, name):
    assert_same_evals(runs[name], runs["single"], model=MODEL)
