"""Preference pairs longer than train.seq_len: answers cut are counted, pairs left without an answer token are
dropped, and the run says so in one warning line naming train.seq_len."""

from __future__ import annotations

import numpy as np
import pytest

from tests.unit.test_preference_data import write_jsonl
from trainctl.config.schema import DataConfig
from trainctl.data import format as dataset
from trainctl.data.chat import RecordOptions
from trainctl.data.prepare import prepare
from trainctl.models.loss_head import IGNORE_INDEX
from trainctl.train.loop.sources import DataError, ShardedTokens
from trainctl.train.preference.pairs import PairBatches, loss_counts_before
from trainctl.train.preference.setup import truncation_warning

SEQ_LEN = 96  # a SHORT pair fits (67 ChatML bytes with its system turn)
SHORT = {"prompt": "Q1", "chosen": "yes", "rejected": "no"}
LONG_ANSWER = {"prompt": "Q2", "chosen": "y" * 80, "rejected": "n"}  # the chosen answer runs past the row
LONG_PROMPT = {"prompt": "Q" * 90, "chosen": "yes", "rejected": "no"}  # both answers start past the row


def prepared(tmp_path, records) -> DataConfig:
    source = write_jsonl(tmp_path / "p.jsonl", records)
    prepare([str(source)], tmp_path / "out", records=RecordOptions("preference"), chat_template="chatml",
            val_fraction=0, workers=1)
    return DataConfig(kind="memmap", datasets=[str(tmp_path / "out")], vocab_size=256)


def batches(cfg: DataConfig, seq_len: int = SEQ_LEN) -> PairBatches:
    return PairBatches(cfg, "train", seq_len, 1, 1, 1, 0, 1, seed=0)


def expected(out: str, width: int) -> tuple[int, int]:
    """(pairs cut, pairs with an answer left empty), counted document by document from the mask file."""
    meta = dataset.read_meta(out)
    flags = np.concatenate([np.fromfile(p, np.uint8) for p in meta.mask_paths("train")])
    starts = [*np.flatnonzero(flags & dataset.DOC_START), flags.size]
    docs = []
    for a, b in zip(starts, starts[1:], strict=False):
        counted = [(f & dataset.LOSS) != 0 for f in flags[a + 1 : b]]
        docs.append((sum(counted[: width - 1]), sum(counted)))
    pairs = list(zip(docs[0::2], docs[1::2], strict=True))
    return (sum(any(kept < total for kept, total in pair) for pair in pairs),
            sum(any(kept == 0 for kept, _ in pair) for pair in pairs))


def test_cut_and_emptied_pairs_are_counted_and_the_empty_ones_dropped(tmp_path):
    cfg = prepared(tmp_path, [SHORT, LONG_ANSWER, LONG_PROMPT, SHORT])
    table = batches(cfg).pairs
    assert (table.truncated, table.dropped) == expected(cfg.datasets[0], SEQ_LEN + 1) == (2, 1)
    assert len(table) == 3
    for p in range(len(table)):  # every pair kept still has a counted target in each of its rows
        _, targets = batches(cfg)._batch([p])
        assert (targets != IGNORE_INDEX).any(dim=1).all()
    line = truncation_warning(SEQ_LEN, batches(cfg), None)
    assert line == ("warning: train.seq_len=96 cuts the answers of 2 of 4 preference pairs; 1 of them dropped (an "
                    "answer kept no token); raise train.seq_len to train on whole answers")
    assert len(line.splitlines()) == 1


def test_a_long_enough_row_cuts_nothing_and_warns_nothing(tmp_path):
    cfg = prepared(tmp_path, [SHORT, LONG_ANSWER, LONG_PROMPT])
    table = batches(cfg, seq_len=256).pairs
    assert (table.truncated, table.dropped, len(table)) == (0, 0, 3)
    assert truncation_warning(256, batches(cfg, seq_len=256), None) is None


def test_only_emptied_pairs_is_refused_naming_the_key(tmp_path):
    cfg = prepared(tmp_path, [LONG_PROMPT, LONG_PROMPT | {"chosen": "sure"}])
    with pytest.raises(DataError, match=r"train.seq_len=96; raise train.seq_len"):
        batches(cfg)


def test_loss_counts_before_crosses_shards():
    rng = np.random.default_rng(0)
    masks = [rng.integers(0, 8, size=n).astype(np.uint8) for n in (5, 1, 9)]
    part = ShardedTokens([np.zeros(m.size, np.uint16) for m in masks], masks)
    flat = np.concatenate(masks)
    positions = np.arange(flat.size + 1)
    want = [int(((flat[:p] & dataset.LOSS) != 0).sum()) for p in positions]
    assert loss_counts_before(part, positions[::-1]).tolist() == want[::-1]


def test_token_windows_have_no_pair_warning():
    assert truncation_warning(SEQ_LEN, object(), None) is None
