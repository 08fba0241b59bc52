"""Batches of preference pairs: each micro-batch holds whole pairs, chosen rows first, then the rejected ones.

A prepared preference dataset (data/preference.py) stores each pair as two documents in a row, the rejected
one's first token flagged REJECTED. Here every document becomes one row of seq_len + 1 tokens (a longer one
keeps its first tokens; a shorter one is padded, its missing targets ignored), so a pair never leaves its
micro-batch or its rank. A micro-batch of M pairs is [2M, seq_len] inputs and targets: rows 0..M-1 are the
chosen answers, rows M..2M-1 the rejected ones, row i and row M + i one pair.

Sampling follows train/loop/data.py's TokenBatches with a pair for a sample: sample j of a step (0 <= j <
global_batch) is the j-th pair drawn by blocks seeded by (seed, block), rank r and micro-batch a read
j = r*(A*M) + a*M + b; the union over ranks is the same global batch whatever the dp / accumulation split,
and a resume continues the sample stream where it stopped.

An answer longer than its row loses its last counted tokens; a pair of which an answer keeps no counted token at
all has nothing to compare (its log-probability is an empty sum) and is dropped when the table is built. Both
are counted (PairTable.truncated, .dropped) for the one warning setup.py prints.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from trainctl.config.schema import DataConfig
from trainctl.core.batch_ramp import BatchRamp
from trainctl.data import format as dataset
from trainctl.models.loss_head import IGNORE_INDEX
from trainctl.train.loop.data import MicroBatch
from trainctl.train.loop.sources import BlendedTokens, DataError, ShardedTokens

_BLOCK = 1024  # pairs drawn per seeded block (as TokenBatches)
_INV_PHI = (math.sqrt(5.0) - 1.0) / 2.0  # eval pairs spread evenly over the split (as TokenBatches)


def document_starts(part: ShardedTokens) -> np.ndarray:
    """The first token of every document of one dataset's split, read shard by shard (int64 offsets)."""
    starts, offset = [], 0
    for mask in part.masks or []:
        starts.append(np.flatnonzero(np.asarray(mask) & dataset.DOC_START) + offset)
        offset += mask.size
    return np.concatenate(starts) if starts else np.zeros(0, np.int64)


def loss_counts_before(part: ShardedTokens, positions: np.ndarray) -> np.ndarray:
    """How many LOSS-flagged tokens of one split come before each position (0..size), one shard in memory."""
    out = np.zeros(positions.size, np.int64)
    offset = carried = 0
    for mask in part.masks or []:
        end = offset + mask.size
        inside = (positions >= offset) & (positions < end)
        counted = np.cumsum((np.asarray(mask) & dataset.LOSS) != 0)
        if inside.any():
            before = positions[inside] - offset  # tokens of this shard before the position
            out[inside] = carried + np.where(before > 0, counted[np.maximum(before - 1, 0)], 0)
        carried += int(counted[-1]) if counted.size else 0
        offset = end
    out[positions >= offset] = carried
    return out


def kept_targets(part: ShardedTokens, starts: np.ndarray, lengths: np.ndarray, width: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(counted targets each document keeps in a row of `width` tokens, counted targets it has): targets are
    tokens 1.. of the document (_row)."""
    first = starts + 1
    before = loss_counts_before(part, np.concatenate([first, starts + np.minimum(lengths, width), starts + lengths]))
    first_count, kept_end, end = np.split(before, 3)
    return kept_end - first_count, end - first_count


class PairTable:
    """Where each pair's two documents are: (dataset, start, length) of the chosen and the rejected one.

    Pairs of which an answer keeps no counted target in a row of `width` tokens are left out (module doc).
    """

    def __init__(self, parts: list[ShardedTokens], key: str, width: int):
        rows = []
        self.truncated = self.dropped = 0  # pairs with an answer cut by the row; of them, pairs left out
        for d, part in enumerate(parts):
            starts = document_starts(part)
            ends = np.append(starts[1:], part.size)
            flags = np.asarray([part.flags(int(s), 1)[0] for s in starts], np.uint8)
            rejected = (flags & dataset.REJECTED) != 0
            if starts.size % 2 or rejected[0::2].any() or not rejected[1::2].all():
                raise DataError(f"{key}: not whole preference pairs (a chosen document, then its rejected one); "
                                "prepare it with `trainctl data prepare --format preference`")
            kept, counted = kept_targets(part, starts, ends - starts, width)
            cut = (kept < counted).reshape(-1, 2).any(axis=1)
            empty = (kept == 0).reshape(-1, 2).any(axis=1)
            self.truncated, self.dropped = self.truncated + int(cut.sum()), self.dropped + int(empty.sum())
            table = np.stack([np.full(starts.size, d), starts, ends - starts], axis=1).reshape(-1, 2, 3)
            rows.append(table[~empty].reshape(-1, 3))
        self.parts = parts
        self.docs = np.concatenate(rows) if rows else np.zeros((0, 3), np.int64)  # [2 * pairs, 3]

    def __len__(self) -> int:
        return len(self.docs) // 2

    def document(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        part, start, length = (int(v) for v in self.docs[index])
        return self.parts[part].window(start, length), self.parts[part].flags(start, length)


def _row(tokens: np.ndarray, flags: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, targets) of one document in `width` tokens: cut or padded; uncounted targets IGNORE_INDEX."""
    tokens, flags = tokens[:width].astype(np.int64), flags[:width]
    targets = np.where((flags[1:] & dataset.LOSS) != 0, tokens[1:], IGNORE_INDEX)
    pad = width - tokens.size
    return np.pad(tokens, (0, pad)), np.pad(targets, (0, pad), constant_values=IGNORE_INDEX)


class PairBatches:
    """TokenBatches' interface for preference pairs (module doc); `masked` is False: the objective, not the
    step's token divisor, normalizes the loss (per pair)."""

    masked = False

    def __init__(self, data_cfg: DataConfig, split: str, seq_len: int, global_batch: int, micro_batch: int,
                 grad_accum: int, dp_rank: int, dp_size: int, seed: int, ramp: BatchRamp | None = None):
        assert global_batch == micro_batch * grad_accum * dp_size, (global_batch, micro_batch, grad_accum, dp_size)
        if ramp is not None and ramp.enabled:  # the launcher refuses it (config/objective_check.py); a hand edit
            raise DataError("train.batch_ramp: preference objectives step whole pairs at a fixed batch; drop "
                            "train.batch_ramp.start and train.batch_ramp.steps")
        self.ramp = BatchRamp(micro_batch * dp_size, grad_accum, grad_accum, 0, 0)  # the fixed batch, as TokenBatches'
        if data_cfg.kind != "memmap" or not data_cfg.datasets:
            raise DataError("train.objective: preference pairs come from data=memmap data.datasets=[DIR] prepared "
                            "with `trainctl data prepare --format preference`")
        self.split, self.seq_len, self.seed = split, seq_len, seed
        self.global_batch, self.micro_batch, self.grad_accum = global_batch, micro_batch, grad_accum
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.vocab_size = data_cfg.vocab_size
        self._base_step = self._base_sample = 0
        blend = BlendedTokens.open(data_cfg.datasets, [], split)
        self.pairs = PairTable(blend.parts, "data.datasets", seq_len + 1)
        self.num_tokens = int(blend.size)
        if not len(self.pairs):
            dropped = self.pairs.dropped
            raise DataError(f"data.datasets: the {split} split holds no preference pair" + (
                f" whose answers both keep a token within train.seq_len={seq_len}; raise train.seq_len" if dropped
                else "; prepare more pairs" + (" or a larger --val-fraction" if split == "val" else "")))

    def resume_at(self, step: int, samples_seen: int) -> None:
        """Continue the pair stream at `samples_seen` from optimizer step `step` on (as TokenBatches)."""
        self._base_step, self._base_sample = step, samples_seen

    def first_sample(self, step: int) -> int:
        return self._base_sample + (step - self._base_step) * self.global_batch

    def sample_ids(self, step: int) -> list[range]:
        first = self.first_sample(step) + self.dp_rank * self.grad_accum * self.micro_batch
        return [range(first + a * self.micro_batch, first + (a + 1) * self.micro_batch) for a in range(self.grad_accum)]

    def micro_batches(self, step: int) -> list[MicroBatch]:
        """This rank's `grad_accum` micro-batches of `micro_batch` pairs each ([2 * micro_batch, seq_len])."""
        return [self._batch([self._drawn(j) for j in ids]) for ids in self.sample_ids(step)]

    def eval_batches(self, n: int) -> list[MicroBatch]:
        """`n` fixed micro-batches of pairs, independent of seed and step, disjoint across dp ranks."""
        first = self.dp_rank * n * self.micro_batch
        return [self._batch([int(((first + i * self.micro_batch + b + 1) * _INV_PHI) % 1.0 * len(self.pairs))
                             for b in range(self.micro_batch)]) for i in range(n)]

    def full_pass(self) -> list[MicroBatch]:
        """Every pair once, in order, `micro_batch` pairs a batch (the last one shorter)."""
        pairs, micro = len(self.pairs), self.micro_batch
        return [self._batch(list(range(i, min(i + micro, pairs)))) for i in range(0, pairs, micro)]

    def _drawn(self, sample: int) -> int:
        block = np.random.default_rng([self.seed, sample // _BLOCK]).integers(0, len(self.pairs), size=_BLOCK)
        return int(block[sample % _BLOCK])

    def _batch(self, pairs: list[int]) -> MicroBatch:
        rows = [_row(*self.pairs.document(2 * p + which), self.seq_len + 1) for which in (0, 1) for p in pairs]
        tokens = np.stack([t for t, _ in rows])
        if int(tokens.max()) >= self.vocab_size:
            raise DataError(f"data.datasets: token id {int(tokens.max())} >= data.vocab_size={self.vocab_size}; "
                            "set data.vocab_size (and model.vocab_size) above the largest id")
        targets = np.stack([t for _, t in rows])
        return MicroBatch(torch.from_numpy(tokens[:, :-1].copy()), torch.from_numpy(targets))
