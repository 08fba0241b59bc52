"""FSDP2 x tensor parallel x pipeline parallel on 8 gloo workers equals one process.

Near-exact rather than bitwise: TP splits matmuls and FSDP/TP/PP reduce partial sums
in a different order than one process does, so results agree to float32 rounding
(~1e-7 relative), well inside the 1e-5 bound.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from worker_runs import TINY, base_config, records, series, train_and_check

from tests.helpers import assert_curve_close
from trainctl.config.schema import ShardingConfig

pytestmark = pytest.mark.dist

STEPS = 10


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    root = tmp_path_factory.mktemp("parity3d")
    model = replace(TINY, n_layers=4)  # 2 pipeline stages of 2 blocks
    single = replace(base_config(data_cache, steps=STEPS, micro_batch=8, grad_accum=1, eval_every=5, eval_batches=1), name="single", model=model)
    # dp 2 x tp 2 x pp 2: each dp rank gets 4 sequences, fed to the pipeline as 4 microbatches of 1.
    # Evaluation: 4 batches of 1 on each of 2 dp ranks = the same 8 held-out sequences as 1 batch of 8.
    three_d = replace(
        base_config(data_cache, steps=STEPS, micro_batch=1, grad_accum=4, eval_every=5, eval_batches=4),
        name="fsdp_tp_pp",
        model=model,
        sharding=ShardingConfig(strategy="fsdp", dp_shard=2, tp=2, pp=2, pp_schedule="1f1b"),
    )
    return {"single": train_and_check(root, single, None), "3d": train_and_check(root, three_d, 8)}


@pytest.mark.parametrize("key", ["loss", "grad_norm"])
def test_fsdp_tp_pp_matches_one_process(runs, key):
    got, want = series(runs["3d"], key), series(runs["single"], key)
    assert len(got) == len(want) == STEPS
    assert_curve_close(got, want, key)


def test_fsdp_tp_pp_eval_matches_one_process(runs):
    got = [r["val_loss"] for r in records(runs["3d"], "eval")]
    want = [r["val_loss"] for r in records(runs["single"], "eval")]
    assert len(got) == len(want) == 3  # step 0, 5, 10
    assert_curve_close(got, want, "val_loss", steps=[0, 5, 10])


def test_every_rank_logged(runs):
    logs = sorted(p.name for p in (runs["3d"] / "logs").glob("rank*.log"))
    assert logs == [f"rank{r}.log" for r in range(8)]
