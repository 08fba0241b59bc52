"""data.document_mask=true through the worker on a masked chat set: training runs end to end, the mask reaches
the model (losses differ from the unmasked run), and sharded layouts (FSDP2, TP) equal one process."""

from __future__ import annotations

from dataclasses import replace

import pytest
from worker_runs import TINY, assert_same_evals, assert_same_steps, base_config, records, series, train_many

from tests.unit.test_masked_loss import chat_set
from trainctl.config.schema import DataConfig, ShardingConfig

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS = 6
SEQ = 128  # several ChatML documents (~50-90 bytes each) packed in every row
LAYOUTS = {
    # name: (sharding, ranks, micro_batch); global batch 8 throughout
    "fsdp2": (ShardingConfig(strategy="fsdp", dp_shard=2), 2, 4),
    "tp2": (ShardingConfig(strategy="none", tp=2), 2, 8),
}


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    root = tmp_path_factory.mktemp("document-mask")
    return root, DataConfig(kind="memmap", datasets=[str(chat_set(root, records=200))], vocab_size=256,
                            document_mask=True)


@pytest.fixture(scope="module")
def runs(chat, data_cache):
    """The layouts' runs and the learning test's two: the runs of one process in one interpreter, the two 2-rank
    layouts in one torchrun (tests/dist/worker_runs.train_many)."""
    root, data = chat
    base = base_config(data_cache, steps=STEPS, seq_len=SEQ, micro_batch=8, eval_every=3, eval_batches=1)
    base = replace(base, model=replace(TINY, max_seq_len=SEQ), data=data)
    cases = {"single": (base, None)}
    for name, (sharding, ranks, micro) in LAYOUTS.items():
        dp = ranks // sharding.tp
        train = replace(base.train, micro_batch=micro, eval_batches=8 // (micro * dp))
        cases[name] = (replace(base, sharding=sharding, train=train), ranks)
    learn = base_config(data_cache, steps=20, seq_len=SEQ, micro_batch=8, eval_every=20, eval_batches=1)
    learn = replace(learn, model=replace(TINY, max_seq_len=SEQ), data=data, optim=replace(learn.optim, lr=1e-2))
    cases["learn-masked"] = (learn, None)
    cases["learn-unmasked"] = (replace(learn, data=replace(data, document_mask=False)), None)
    return train_many(root, cases)


def test_a_masked_run_learns_end_to_end_and_the_mask_reaches_the_model(runs):
    """20 steps at a high rate: an untrained model barely reads its context, a trained one does."""
    masked, unmasked = runs["learn-masked"], runs["learn-unmasked"]
    losses = series(masked, "loss")
    assert len(losses) == 20 and all(x == x for x in losses) and losses[-1] < losses[0] / 5  # learns, no NaN
    got, other = (records(run, "eval")[-1]["val_loss"] for run in (masked, unmasked))
    # The same batches without the mask: documents see their predecessors, and the held-out loss differs (by ~7%).
    assert abs(got - other) > 0.01 * other


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("key", ["loss", "grad_norm"])
def test_a_sharded_layout_with_the_mask_matches_one_process(runs, name, key):
    assert_same_steps(runs[name], runs["single"], key, STEPS, seq_len=SEQ)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_eval_with_the_mask_matches_one_process(runs, name):
    assert_same_evals(runs[name], runs["single"], seq_len=SEQ)
