"""Training on a chat set whose prompts are random and whose answers are fixed: the answer loss goes to about zero;
2-rank DDP, whose ranks count different numbers of answer tokens, equals one process; a step whose masks leave
no target is skipped and counted, never a NaN."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from pathlib import Path

import pytest
from worker_runs import base_config, records, series, train_and_check

from tests.helpers import assert_curve_close
from tests.unit.test_masked_loss import chat_set
from trainctl.config.schema import DataConfig, ShardingConfig
from trainctl.data.chat import RecordOptions
from trainctl.data.prepare import prepare
from trainctl.train.loop.data import TokenBatches
from trainctl.train.loop.loss import counted_targets

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def chat_config(data_cache: Path, out: Path, name: str, **train):
    cfg = base_config(data_cache, **train)
    return replace(cfg, name=name, data=DataConfig(kind="memmap", datasets=[str(out)], vocab_size=256))


def test_ddp_with_uneven_counts_equals_one_process(tmp_path, data_cache):
    out = chat_set(tmp_path, records=200)
    ddp = chat_config(data_cache, out, "ddp", steps=6, micro_batch=2, grad_accum=2)
    counts = [counted_targets(TokenBatches(ddp.data, "train", 64, 8, 2, 2, rank, 2, seed=1).micro_batches(0))
              for rank in range(2)]
    assert counts[0] != counts[1] and min(counts) > 0  # the ranks count different numbers of targets
    single = train_and_check(tmp_path, chat_config(data_cache, out, "single", steps=6, micro_batch=8), None)
    two = train_and_check(tmp_path, replace(ddp, sharding=ShardingConfig(strategy="ddp", dp_replicate=2)), 2)
    for key in ("loss", "grad_norm"):
        assert_curve_close(series(two, key), series(single, key), key)


def test_answer_loss_goes_to_zero(tmp_path, data_cache):
    out = chat_set(tmp_path, records=300)
    cfg = chat_config(data_cache, out, "learn", steps=120, eval_every=120, eval_batches=4)
    cfg = replace(cfg, optim=replace(cfg.optim, lr=3e-3))
    run = train_and_check(tmp_path, cfg, None)
    evals = [r["val_loss"] for r in records(run, "eval")]
    # the val loss counts answer tokens only: fixed text, so it is learnable to ~0 (prompts are random digits,
    # whose loss would stay near log(10) = 2.3 if they counted)
    assert evals[0] > 3 and evals[-1] < 0.05, evals


def test_step_without_counted_targets_is_skipped_and_counted(tmp_path, data_cache):
    rng = random.Random(1)
    lines = [json.dumps({"messages": [{"role": "user", "content": "".join(rng.choices("0123456789", k=100))},
                                      {"role": "assistant", "content": "ok"}]}) for _ in range(40)]
    (tmp_path / "long.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "long"
    prepare([str(tmp_path / "long.jsonl")], out, workers=1, val_fraction=0.2, chat_template="chatml",
            records=RecordOptions("chat"))
    cfg = chat_config(data_cache, out, "empty", steps=20, micro_batch=1, global_batch=1, seq_len=16, eval_every=0)
    data = TokenBatches(cfg.data, "train", 16, 1, 1, 1, 0, 1, seed=cfg.train.seed)
    empty = sum(counted_targets(data.micro_batches(step)) == 0 for step in range(20))
    assert 0 < empty < 20
    run = train_and_check(tmp_path, replace(cfg, model=replace(cfg.model, max_seq_len=16)), None)
    steps = records(run, "train")
    assert len(steps) == 20 and all(math.isfinite(r["loss"]) for r in steps)
    assert steps[-1]["guard_empty_batches"] == empty
    logs = "\n".join(p.read_text() for p in (run / "logs").glob("*.log"))
    assert "the loss masks leave no target token" in logs
