"""Where a split's tokens come from: flat token files, a prepared dataset's shards, a blend of datasets.

Each source answers the same questions for the batch sampler (data.py): how many windows of a length it
holds (`num_starts`), the tokens of one window (`window`) and, for prepared chat / instruction datasets, their
mask flags (`flags`, data/format.py's LOSS and DOC_START bits; None without masks). Separate from the batches so
that the sampling and the reading of files change apart; separate from data_setup.py (which builds and checks
the files before training) so that the readers stay small.

Prepared chat / instruction datasets carry a mask file per shard (data/format.py): data.py makes a window's
targets whose mask lacks the LOSS bit IGNORE_INDEX, which the loss skips; datasets without masks count every
target.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from trainctl.data.format import LOSS
from trainctl.train.errors import WorkerConfigError


class DataError(WorkerConfigError):  # exit 2, like any config error
    """A problem with the data that the user caused and can fix (message names the config key)."""


def open_token_file(path: Path, dtype: str, key: str) -> np.ndarray:
    """A read-only memmap of a flat token file, or a DataError naming the key that points at it."""
    if not path.is_file():
        raise DataError(f"{key}={str(path)!r}: file not found; point it at a flat token file")
    size, itemsize = path.stat().st_size, np.dtype(dtype).itemsize
    if size == 0:
        raise DataError(f"{key}={str(path)!r}: file is empty; it needs at least train.seq_len+1 tokens")
    if size % itemsize:
        raise DataError(f"{key}={str(path)!r}: {size} bytes is not a multiple of {itemsize} ({dtype}); "
                        "check data.token_dtype")
    return np.memmap(path, dtype=dtype, mode="r")


def open_mask_file(path: Path, tokens: int, key: str) -> np.ndarray:
    """A shard's mask file: exactly one flag byte per token, or every later flag would sit beside another token."""
    if not path.is_file():
        raise DataError(f"{key}: mask file {path.name} is missing; prepare the dataset again")
    size = path.stat().st_size
    if size != tokens:
        raise DataError(f"{key}: mask file {path.name} is {size} bytes, its shard has {tokens} tokens (one mask "
                        "byte each); prepare the dataset again")
    return np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)


# ---------------------------------------------------------------- token sources


class FlatTokens:
    """One flat token array (a user's file or the stdlib cache): starts are offsets into it."""

    masked = False

    def __init__(self, tokens: np.ndarray):
        self.tokens, self.size = tokens, int(tokens.size)

    def flags(self, start: int, length: int) -> np.ndarray | None:
        """The mask flags of a window (data/format.py's LOSS and DOC_START bits), None without masks."""
        return None

    def arrays(self) -> list[np.ndarray]:
        return [self.tokens]

    def num_starts(self, length: int) -> int:
        # A sample reads `length` tokens, so the last valid start is size - length.
        return self.size - length + 1

    def window(self, start: int, length: int) -> np.ndarray:
        return self.tokens[start : start + length]


class ShardedTokens(FlatTokens):
    """The shards of one prepared dataset's split, read as one stream (a window may span two shards), with
    their mask files when the dataset has them (each as long as its shard)."""

    def __init__(self, shards: list[np.ndarray], masks: list[np.ndarray] | None = None):
        keep = [i for i, s in enumerate(shards) if s.size]
        self.shards = [shards[i] for i in keep]
        self.masks = None if masks is None else [masks[i] for i in keep]
        self.masked = masks is not None
        self.ends = np.cumsum([s.size for s in self.shards])
        self.size = int(self.ends[-1]) if self.shards else 0

    def arrays(self) -> list[np.ndarray]:
        return self.shards

    def window(self, start: int, length: int) -> np.ndarray:
        return self._read(self.shards, start, length)

    def flags(self, start: int, length: int) -> np.ndarray | None:
        return None if self.masks is None else self._read(self.masks, start, length)

    def _read(self, arrays: list[np.ndarray], start: int, length: int) -> np.ndarray:
        index = int(np.searchsorted(self.ends, start, side="right"))
        begin = start - (int(self.ends[index - 1]) if index else 0)
        piece = arrays[index][begin : begin + length]
        if piece.size == length:
            return piece
        pieces = [piece]
        while sum(p.size for p in pieces) < length:
            index += 1
            pieces.append(arrays[index][: length - sum(p.size for p in pieces)])
        return np.concatenate(pieces)


class BlendedTokens:
    """Several prepared datasets, each drawn with its weight (default: its share of the tokens).

    Starts live in one virtual range: dataset d owns a stretch proportional to its weight, and a start
    inside it maps linearly onto d's own valid starts. With weights equal to the token counts this is
    plain uniform sampling over all the data; the mapping depends only on the datasets and weights,
    so a resume reads exactly the samples the interrupted run would have read.
    """

    def __init__(self, parts: list[ShardedTokens], weights: list[float]):
        self.parts, self.weights = parts, weights
        self.size = sum(p.size for p in parts)

    @classmethod
    def open(cls, paths: list[str], weights: list[float], split: str) -> BlendedTokens:
        from trainctl.data import format as dataset

        parts = []
        for path in paths:
            try:
                meta = dataset.read_meta(path)
            except dataset.DatasetError as exc:
                raise DataError(f"data.datasets: {exc}") from None
            key = f"data.datasets ({path})"
            shards = [open_token_file(p, meta.token_dtype, key) for p in meta.shard_paths(split)]
            masks = meta.mask_paths(split)
            if masks is not None:
                masks = [open_mask_file(m, shard.size, key) for m, shard in zip(masks, shards, strict=True)]
            parts.append(ShardedTokens(shards, masks))
        return cls(parts, list(weights) or [float(p.size) for p in parts])

    @property
    def masked(self) -> bool:
        return any(p.masked for p in self.parts)

    def arrays(self) -> list[np.ndarray]:
        return [a for p in self.parts for a in p.arrays()]

    def _stretches(self, length: int) -> np.ndarray:
        starts = [max(p.num_starts(length), 0) for p in self.parts]
        total = sum(starts)
        share = np.asarray([w if n > 0 else 0.0 for w, n in zip(self.weights, starts, strict=True)])
        return np.maximum(np.round(share / share.sum() * total), (share > 0).astype(np.int64)).astype(np.int64)

    def num_starts(self, length: int) -> int:
        return int(self._stretches(length).sum())

    def window(self, start: int, length: int) -> np.ndarray:
        part, local = self._locate(start, length)
        return self.parts[part].window(local, length)

    def flags(self, start: int, length: int) -> np.ndarray | None:
        """A masked blend's flags: a dataset without masks counts every target (LOSS everywhere)."""
        if not self.masked:
            return None
        part, local = self._locate(start, length)
        flags = self.parts[part].flags(local, length)
        return np.full(length, LOSS, dtype=np.uint8) if flags is None else flags

    def _locate(self, start: int, length: int) -> tuple[int, int]:
        """(dataset, its own start) of a start in the virtual range."""
        stretches = self._stretches(length)
        ends = np.cumsum(stretches)
        d = int(np.searchsorted(ends, start, side="right"))
        local = start - (int(ends[d - 1]) if d else 0)
        own = self.parts[d].num_starts(length)
        return d, local * own // int(stretches[d])


TokenSource = FlatTokens | BlendedTokens
