"""The worker's batches: each a pure function of (seed, step), read from a split's token source.

The token sources are in sources.py, the checks and the stdlib cache that come before the first batch in
data_setup.py; this module holds only what turns windows of tokens into (inputs, targets) micro-batches.

With `data.document_mask` each micro-batch also carries every input token's position in its document
(MicroBatch.positions): 0 at each DOC_START flag and at a row's first token (a row that starts inside a
document starts a segment there: its earlier tokens are outside the window). A target that begins the next
document is IGNORE_INDEX: no document learns to predict another one's first token.

Sampling: the training samples form one stream; step s reads the next global batch of it (under train.batch_ramp
the batch of step s, core/batch_ramp.py); its sample j is stream index first_sample(s) + j, and rank r,
micro-batch a, row b reads j = r*(A*M) + a*M + b with A that step's grad_accum. The union over ranks and
micro-batches is therefore the same global batch whatever the dp / accumulation split.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch

from trainctl.config.schema import DataConfig
from trainctl.core.batch_ramp import BatchRamp
from trainctl.data.format import DOC_START, LOSS
from trainctl.models.loss_head import IGNORE_INDEX
from trainctl.train.loop.data_setup import SPLITS, STDLIB_VOCAB, check_config, open_split
from trainctl.train.loop.sources import DataError, TokenSource

# Nonzero stream tags: numpy's SeedSequence treats [a, b] and [a, b, 0] alike, so a tag of 0 could collide.
_SPLIT_TAG = {"train": 1, "val": 2}
_EVAL_TAG = 0x5EED_E7A1
# Golden-ratio (Kronecker) sequence: eval sample j sits at frac(j * phi^-1) of the valid starts. Any prefix
# is spread evenly over the whole split, and sample j does not depend on how many samples are asked for,
# so the eval set of dp=2 x n=4 equals that of dp=1 x n=8.
_INV_PHI = (math.sqrt(5.0) - 1.0) / 2.0
# Training samples are drawn in blocks: sample k is draw k % _BLOCK of the block seeded by (seed, k // _BLOCK),
# so any rank finds any sample without drawing the whole stream.
_BLOCK = 1024


class MicroBatch(tuple):
    """An (inputs, targets) pair, unpacked as one everywhere, that also carries `positions` [rows, seq] (int64):
    each input token's position in its packed document under data.document_mask, else None."""

    positions: torch.Tensor | None

    def __new__(cls, inputs: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None):
        pair = super().__new__(cls, (inputs, targets))
        pair.positions = positions
        return pair


def document_positions(flags: np.ndarray) -> np.ndarray:
    """[rows, seq] position of each token in its document: 0 where DOC_START is set and at each row's first token."""
    index = np.arange(flags.shape[1])
    # The latest start at or before each token; index 0 stands in for a row that begins inside a document.
    return index - np.maximum.accumulate(np.where((flags & DOC_START) != 0, index, 0), axis=1)


def to_inputs_targets(samples: np.ndarray, flags: np.ndarray | None = None,
                       document_mask: bool = False) -> MicroBatch:
    """Split [rows, seq_len+1] tokens into int64 (inputs, targets), targets shifted by one token; a target whose
    flags lack LOSS (a prompt token, a chat's separator) becomes IGNORE_INDEX, and so does, with
    `document_mask`, one that starts a document (the inputs' positions come along)."""
    batch = torch.from_numpy(samples.astype(np.int64))
    inputs, targets = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
    if flags is None:
        return MicroBatch(inputs, targets)
    # A copy: for one row both slices are already contiguous views of `batch`, overlapping the inputs.
    targets = targets.clone()
    targets[torch.from_numpy((flags[:, 1:] & LOSS) == 0)] = IGNORE_INDEX
    if not document_mask:
        return MicroBatch(inputs, targets)
    targets[torch.from_numpy((flags[:, 1:] & DOC_START) != 0)] = IGNORE_INDEX
    return MicroBatch(inputs, targets, torch.from_numpy(document_positions(flags[:, :-1])))


class TokenBatches:
    """Batches of one split for one data-parallel rank, each a pure function of (seed, step)."""

    def __init__(self, data_cfg: DataConfig, split: str, seq_len: int, global_batch: int, micro_batch: int,
                 grad_accum: int, dp_rank: int, dp_size: int, seed: int, ramp: BatchRamp | None = None):
        assert split in SPLITS, split
        assert global_batch == micro_batch * grad_accum * dp_size, (global_batch, micro_batch, grad_accum, dp_size)
        assert 0 <= dp_rank < dp_size and seq_len >= 1, (dp_rank, dp_size, seq_len)
        check_config(data_cfg)
        if seed < 0:
            raise DataError(f"train.seed={seed} must be >= 0 (it seeds numpy's batch sampler)")
        self.split, self.seq_len, self.seed = split, seq_len, seed
        self.global_batch, self.micro_batch, self.grad_accum = global_batch, micro_batch, grad_accum
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self._base_step = self._base_sample = 0  # see resume_at
        # The batch of each step: train.batch_ramp's, or global_batch throughout
        self.ramp = ramp or BatchRamp(micro_batch * dp_size, grad_accum, grad_accum, 0, 0)
        self.vocab_size = STDLIB_VOCAB if data_cfg.kind == "stdlib" else data_cfg.vocab_size
        self.document_mask = data_cfg.document_mask
        self._tokens: TokenSource | None = None  # None: synthetic
        if data_cfg.kind == "synthetic" and self.document_mask:
            raise DataError("data.document_mask=true: synthetic data has no documents; use prepared chat datasets")
        if data_cfg.kind != "synthetic":
            self._tokens, self._key = open_split(data_cfg, split)
            if data_cfg.document_mask and not self._tokens.masked:
                raise DataError(f"data.document_mask=true: {self._key} marks no document starts; use datasets "
                                "prepared with --format chat or instruction, or data.document_mask=false")
            if self._tokens.size < seq_len + 1:
                raise DataError(f"{self._key}: the {split} split has {self._tokens.size} tokens, "
                                f"fewer than train.seq_len+1="
                                f"{seq_len + 1}; use more data or a smaller train.seq_len")

    @property
    def masked(self) -> bool:
        """Whether only some targets count (a chat / instruction dataset): the step must count them."""
        return self._tokens is not None and self._tokens.masked

    @property
    def num_tokens(self) -> int | None:
        """Tokens in this split (None for synthetic data)."""
        return None if self._tokens is None else int(self._tokens.size)

    def resume_at(self, step: int, samples_seen: int) -> None:
        """Continue the sample stream at `samples_seen` from optimizer step `step` on.

        The stream is indexed by sample, not by step: a resume with another world size (or even
        another global batch) reads the samples that the interrupted run would have read next.
        """
        assert 0 <= step and 0 <= samples_seen, (step, samples_seen)
        self._base_step, self._base_sample = step, samples_seen

    def first_sample(self, step: int) -> int:
        """Stream index of the first sample of `step`'s global batch."""
        ramp = self.ramp
        return self._base_sample + ramp.sequences_before(step) - ramp.sequences_before(self._base_step)

    def sample_ids(self, step: int) -> list[range]:
        """The stream indices of this rank's micro-batches of `step` (its grad_accum; what micro_batches reads)."""
        assert step >= self._base_step, (step, self._base_step)
        accum = self.ramp.accum_at(step)
        first_of_rank = self.first_sample(step) + self.dp_rank * accum * self.micro_batch
        return [range(first_of_rank + a * self.micro_batch, first_of_rank + (a + 1) * self.micro_batch)
                for a in range(accum)]

    def micro_batches(self, step: int) -> list[MicroBatch]:
        """This rank's (inputs, targets) pairs of shape [micro_batch, seq_len] for `step`, its grad_accum of them."""
        ids = self.sample_ids(step)
        first_of_rank = ids[0].start
        starts = self._sample_starts(first_of_rank, len(ids) * self.micro_batch)
        out = []
        for sample_ids in ids:
            if self._tokens is None:
                rows = [(self._synthetic_sample([self.seed, j, _SPLIT_TAG[self.split]]), None) for j in sample_ids]
            else:
                rows = [self._window(int(starts[j - first_of_rank])) for j in sample_ids]
            out.append(self._checked_pair(rows))
        return out

    def eval_batches(self, n: int) -> list[MicroBatch]:
        """`n` fixed micro-batches for this rank: independent of seed and step, disjoint across dp ranks.

        Eval sample j = dp_rank * n * micro_batch + i * micro_batch + b, so the union over ranks is the
        same set for any dp split with the same total. Held out when split == "val".
        """
        per_rank = n * self.micro_batch
        out = []
        for i in range(n):
            first = self.dp_rank * per_rank + i * self.micro_batch
            sample_ids = range(first, first + self.micro_batch)
            if self._tokens is None:
                rows = [(self._synthetic_sample([_EVAL_TAG, j, _SPLIT_TAG[self.split]]), None) for j in sample_ids]
            else:
                rows = [self._window(self._eval_start(j)) for j in sample_ids]
            out.append(self._checked_pair(rows))
        return out

    def full_pass_rows(self) -> int:
        """How many windows one full pass reads (see full_pass)."""
        return math.ceil((self._tokens.size - 1) / self.seq_len)

    def full_pass(self, rows: int | None = None) -> Iterator[MicroBatch]:
        """The split once, in order, as windows that do not overlap (the first `rows` of them; None: all).

        Row k reads tokens [k*seq_len, k*seq_len + seq_len + 1): consecutive rows share one token, the last
        target of one row and the first input of the next, so every token after the split's first is a target
        exactly once. The last row, shorter, is padded with ignored targets. A generator: a big split is never
        held in memory.
        """
        rows = self.full_pass_rows() if rows is None else min(rows, self.full_pass_rows())
        for first in range(0, rows, self.micro_batch):
            last = min(first + self.micro_batch, rows)
            yield self._padded_pair([self._full_pass_row(k) for k in range(first, last)])

    def eval_positions(self, n: int) -> int:
        """How many distinct token positions the targets of eval_batches(n) cover on this rank: windows drawn
        apart may overlap, and a position read twice is one token of the split, not two."""
        starts = np.sort(np.array([self._eval_start(self.dp_rank * n * self.micro_batch + j)
                                   for j in range(n * self.micro_batch)], dtype=np.int64))
        ends = starts + self.seq_len  # each window's targets are positions [start + 1, start + seq_len]
        reach = np.maximum.accumulate(ends)
        added = np.minimum(self.seq_len, ends[1:] - reach[:-1]).clip(min=0)  # what each window adds past the others
        return int(self.seq_len + added.sum())

    def _full_pass_row(self, k: int) -> tuple[np.ndarray, np.ndarray | None]:
        start = k * self.seq_len
        length = min(self.seq_len + 1, self._tokens.size - start)
        return self._tokens.window(start, length), self._tokens.flags(start, length)

    def _padded_pair(self, rows: list[tuple[np.ndarray, np.ndarray | None]]) -> MicroBatch:
        """Rows of up to seq_len + 1 tokens as one micro-batch: a short row's missing targets are ignored."""
        width = self.seq_len + 1
        lengths = [tokens.size for tokens, _ in rows]
        pad = [(np.pad(t, (0, width - t.size)), None if f is None else np.pad(f, (0, width - f.size)))
               for t, f in rows]
        batch = self._checked_pair(pad)
        targets = batch[1].clone()  # one row's targets may be a view sharing memory with its inputs
        for row, length in enumerate(lengths):
            targets[row, length - 1:] = IGNORE_INDEX
        return MicroBatch(batch[0], targets, batch.positions)

    def _num_starts(self) -> int:
        return self._tokens.num_starts(self.seq_len + 1)

    def _sample_starts(self, first: int, count: int) -> np.ndarray | None:
        """Start offsets of stream samples [first, first + count): blocks of draws seeded by (seed, block)."""
        if self._tokens is None:
            return None
        blocks = range(first // _BLOCK, (first + count - 1) // _BLOCK + 1)
        draws = np.concatenate([np.random.default_rng([self.seed, b]).integers(0, self._num_starts(), size=_BLOCK)
                                for b in blocks])
        offset = first - blocks[0] * _BLOCK
        return draws[offset : offset + count]

    def _eval_start(self, j: int) -> int:
        return int(((j + 1) * _INV_PHI) % 1.0 * self._num_starts())

    def _window(self, start: int) -> tuple[np.ndarray, np.ndarray | None]:
        return self._tokens.window(start, self.seq_len + 1), self._tokens.flags(start, self.seq_len + 1)

    def _synthetic_sample(self, seed_words: list[int]) -> np.ndarray:
        # Seeded per sample so a rank generates only its own rows, whatever the global batch.
        rng = np.random.default_rng(seed_words)
        return rng.integers(0, self.vocab_size, size=self.seq_len + 1, dtype=np.int64)

    def _checked_pair(self, rows: list[tuple[np.ndarray, np.ndarray | None]]) -> MicroBatch:
        samples = np.stack([tokens for tokens, _ in rows])
        flags = np.stack([f for _, f in rows]) if self.masked else None
        # One max over the rows we read anyway: an out-of-range id would otherwise surface as an opaque
        # index error (or a CUDA device assert) inside the embedding.
        if self._tokens is not None and int(samples.max()) >= self.vocab_size:
            raise DataError(f"{self._key}: token id {int(samples.max())} >= data.vocab_size={self.vocab_size}; "
                            f"set data.vocab_size (and model.vocab_size) above the largest id")
        return to_inputs_targets(samples, flags, self.document_mask)
