"""`trainctl eval`'s windows: one full pass scores every token of a split once, in windows that do not overlap;
sampled windows report the distinct tokens they cover; --batches beyond the split is one full pass, said so."""

from __future__ import annotations

import numpy as np
import pytest

from trainctl.config.schema import DataConfig
from trainctl.core.tool_options import EvalOptions
from trainctl.data.prepare import prepare
from trainctl.models.loss_head import IGNORE_INDEX
from trainctl.train.evaluate import EvalError, chosen_windows, dataset_of
from trainctl.train.loop.data import TokenBatches

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def eval_only(tmp_path_factory):
    """An eval-only byte dataset (--val-fraction 1) of two shards, and its val tokens in order."""
    folder = tmp_path_factory.mktemp("evalset")
    (folder / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 30)
    meta = prepare([str(folder / "a.txt")], folder / "ds", val_fraction=1.0, workers=1, shard_tokens=700)
    assert meta.splits["train"].tokens == 0 and len(meta.splits["val"].shards) == 2
    tokens = np.concatenate([np.fromfile(path, dtype=meta.token_dtype) for path in meta.shard_paths("val")])
    return str(folder / "ds"), tokens


def batches_of(data: str, seq_len: int, micro_batch: int) -> TokenBatches:
    cfg = DataConfig(kind="memmap", datasets=[data], vocab_size=256)
    return TokenBatches(cfg, "val", seq_len, micro_batch, micro_batch, 1, 0, 1, seed=0)


@pytest.mark.parametrize("seq_len,micro_batch", [(16, 3), (7, 2), (1, 1), (64, 4)])
def test_a_full_pass_scores_every_token_after_the_first_once(eval_only, seq_len, micro_batch):
    data, tokens = eval_only
    source = batches_of(data, seq_len, micro_batch)
    scored = []
    for inputs, targets in source.full_pass():
        assert inputs.shape == targets.shape == (inputs.shape[0], seq_len)
        scored += targets[targets != IGNORE_INDEX].tolist()  # row-major: the split's order
    assert scored == tokens[1:].tolist()
    assert source.full_pass_rows() == -(-(tokens.size - 1) // seq_len)


def test_sampled_windows_count_each_covered_token_once(eval_only):
    data, tokens = eval_only
    source = batches_of(data, 16, 3)
    for n in (1, 4, 40):
        covered = set()
        for j in range(n * 3):
            start = source._eval_start(j)
            covered.update(range(start + 1, start + 17))
        assert source.eval_positions(n) == len(covered) <= tokens.size - 1


def test_batches_beyond_the_split_are_one_full_pass_and_say_so(eval_only):
    data, tokens = eval_only
    source = batches_of(data, 16, 3)
    windows, batches, positions, note = chosen_windows(source, 100_000, full=False)
    assert batches == -(-source.full_pass_rows() // 3) and positions == tokens.size - 1
    assert sum(1 for _ in windows) == batches and "--batches 100000 holds more than" in note
    _, batches, positions, note = chosen_windows(source, 2, full=False)
    assert batches == 2 and note is None and positions == source.eval_positions(2)


def test_a_missing_data_path_is_named_as_file_or_folder(tmp_path):
    with pytest.raises(EvalError, match="no such file or folder"), dataset_of(tmp_path, str(tmp_path / "nope")):
        pass


@pytest.mark.parametrize("values,wanted", [
    ({}, "nothing to evaluate"),
    ({"data": "d", "full": True, "batches": 3}, "--all and --batches 3: pick one"),
    ({"data": "d", "split": "test"}, "--split test"),
    ({"tasks": " , "}, "name at least one task"),
    ({"data": "d", "limit": 3}, "go with --tasks"),
])
def test_eval_options_refuse_what_cannot_work(values, wanted):
    assert any(wanted in line for line in EvalOptions(**values).problems())
