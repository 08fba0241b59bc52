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
from worker_runs import base_config, records, series, train_many

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


def long_prompt_set(root: Path) -> Path:
    """Prompts of 100 digits, answers "ok": at 16 tokens a row, many steps hold no answer token at all."""
    rng = random.Random(1)
    lines = [json.dumps({"messages": [{"role": "user", "content": "".join(rng.choices("0123456789", k=100))},
                                      {"role": "assistant", "content": "ok"}]}) for _ in range(40)]
    (root / "long.jsonl").write_text("\n".join(lines) + "\n")
    prepare([str(root / "long.jsonl")], root / "long", workers=1, val_fraction=0.2, chat_template="chatml",
            records=RecordOptions("chat"))
    return root / "long"


@pytest.fixture(scope="module")
def cases(tmp_path_factory, data_cache) -> dict:
    """Every test's configs, by run name."""
    sets = {n: chat_set(tmp_path_factory.mktemp(f"chat{n}"), records=n) for n in (200, 300)}
    ddp = chat_config(data_cache, sets[200], "ddp", steps=6, micro_batch=2, grad_accum=2)
    learn = chat_config(data_cache, sets[300], "learn", steps=120, eval_every=120, eval_batches=4)
    empty = chat_config(data_cache, long_prompt_set(tmp_path_factory.mktemp("masked-long")), "empty", steps=20,
                        micro_batch=1, global_batch=1, seq_len=16, eval_every=0)
    return {"single": (chat_config(data_cache, sets[200], "single", steps=6, micro_batch=8), None),
            "ddp": (replace(ddp, sharding=ShardingConfig(strategy="ddp", dp_replicate=2)), 2),
            "learn": (replace(learn, optim=replace(learn.optim, lr=3e-3)), None),
            "empty": (replace(empty, model=replace(empty.model, max_seq_len=16)), None)}


@pytest.fixture(scope="module")
def runs(cases, tmp_path_factory) -> dict[str, Path]:
    """The runs of one process in one interpreter, the 2-rank run in its torchrun (worker_runs.train_many)."""
    return train_many(tmp_path_factory.mktemp("masked-runs"), cases)


def test_ddp_with_uneven_counts_equals_one_process(cases, runs):
    ddp = cases["ddp"][0]
    counts = [counted_targets(TokenBatches(ddp.data, "train", 64, 8, 2, 2, rank, 2, seed=1).micro_batches(0))
              for rank in range(2)]
    assert counts[0] != counts[1] and min(counts) > 0  # the ranks count different numbers of targets
    for key in ("loss", "grad_norm"):
        assert_curve_close(series(runs["ddp"], key), series(runs["single"], key), key)


def test_answer_loss_goes_to_zero(runs):
    evals = [r["val_loss"] for r in records(runs["learn"], "eval")]
    # the val loss counts answer tokens only: fixed text, so it is learnable to ~0 (prompts are random digits,
    # whose loss would stay near log(10) = 2.3 if they counted)
    assert evals[0] > 3 and evals[-1] < 0.05, evals


def test_step_without_counted_targets_is_skipped_and_counted(cases, runs):
    cfg = cases["empty"][0]
    data = TokenBatches(cfg.data, "train", 16, 1, 1, 1, 0, 1, seed=cfg.train.seed)
    empty = sum(counted_targets(data.micro_batches(step)) == 0 for step in range(20))
    assert 0 < empty < 20
    run = runs["empty"]
    steps = records(run, "train")
    assert len(steps) == 20 and all(math.isfinite(r["loss"]) for r in steps)
    assert steps[-1]["guard_empty_batches"] == empty
    logs = "\n".join(p.read_text() for p in (run / "logs").glob("*.log"))
    assert "the loss masks leave no target token" in logs
