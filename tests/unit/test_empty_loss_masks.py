"""Masked data with nothing in the loss (issue 35): refused before a launch, failed by the worker if every step is
empty (never COMPLETED with loss 0.0), and a val loss of nan says why."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trainctl.data.chat import RecordOptions
from trainctl.data.format import META_FILE, dataset_problems
from trainctl.data.prepare import prepare
from trainctl.train.errors import WorkerError
from trainctl.train.loop.trainer import check_something_trained
from trainctl.train.observe.console import console_line

CHAT = [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]}
        for i in range(40)]


@pytest.fixture
def chat_set(tmp_path):
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in CHAT))
    prepare([str(tmp_path / "c.jsonl")], tmp_path / "set", workers=1, val_fraction=0.3, chat_template="chatml",
            records=RecordOptions("chat"))
    return tmp_path / "set"


def _empty_masks(root, split: str) -> None:
    """The split's masks as a dataset with no answer has them: no LOSS bit anywhere, and meta.json saying so."""
    meta = json.loads((root / META_FILE).read_text())
    for shard in meta["splits"][split]["shards"]:
        flags = np.fromfile(root / shard["mask"], np.uint8)
        (flags & ~np.uint8(1)).tofile(root / shard["mask"])
    meta["splits"][split]["loss_tokens"] = 0
    (root / META_FILE).write_text(json.dumps(meta))


@pytest.mark.parametrize("split, says", [
    ("train", "no train token counts in the loss (every loss mask is empty), so every step would be skipped"),
    ("val", "no val token counts in the loss (every val loss mask is empty), so the val loss would be nan"),
])
def test_a_split_with_nothing_in_the_loss_is_refused_before_a_launch(chat_set, split, says):
    assert dataset_problems(chat_set, split, 256, 16) == []
    _empty_masks(chat_set, split)
    assert [p for p in dataset_problems(chat_set, split, 256, 16) if says in p] != []


def test_a_run_whose_every_step_was_empty_fails():
    with pytest.raises(WorkerError, match="no step trained: in all 5 steps the loss masks left no target token"):
        check_something_trained(empty=5, ran=5, stopped=False)
    check_something_trained(empty=4, ran=5, stopped=False)  # one step trained: the run is real
    check_something_trained(empty=2, ran=2, stopped=True)  # stopped early: nothing to conclude
    check_something_trained(empty=0, ran=0, stopped=False)  # a restart after the final checkpoint


def test_a_nan_val_loss_over_no_target_says_why():
    line = console_line({"kind": "eval", "step": 4, "val_loss": float("nan"), "val_targets": 0})
    assert line.startswith("eval step 4") and "val loss nan (no val token counts in the loss" in line
    assert "(" not in console_line({"kind": "eval", "step": 4, "val_loss": 2.5, "val_targets": 100})
