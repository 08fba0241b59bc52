"""The shard files of a dataset being prepared, and the record that lets an interrupted run resume exactly.

A split is one stream of tokens cut into `SPLIT-NNNNN.bin` files of `limit` tokens each (the last one
shorter), so where a token lies follows from its position alone. Every finished piece of input (a unit)
appends one segment to each split and records it: its tokens, its documents and the sha256 of its bytes.
A resume re-reads the recorded segments in order and keeps the units whose segments all read back
intact; the first one that does not (a shard truncated, deleted, extended or changed) and everything after
it is cut away and done again, so the result is byte-identical to an uninterrupted run.

The record (`.prepare-state.json`) is JSON lines: a header (the arguments' fingerprint, the trained
tokenizer's sha256), then one line per unit, appended and fsync-ed after the unit's shards are: writing it
costs the same for the ten-thousandth unit as for the first. A torn last line (a crash while appending)
ends the record there.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from trainctl.data.format import DatasetError

READ_BLOCK = 8 << 20
MASK_SUFFIX = ".mask"


def load_state(path: Path) -> dict:
    """The header with its "units"; ValueError when even the header is unreadable."""
    lines = path.read_bytes().split(b"\n")
    state = json.loads(lines[0])
    if not isinstance(state, dict):
        raise ValueError("the header is not an object")
    units = []
    for line in lines[1:]:
        try:
            unit = json.loads(line)
        except ValueError:
            break  # a torn line: the record ends before it
        if not _is_unit(unit):
            break
        units.append(unit)
    return {**state, "units": units}


def _is_unit(unit) -> bool:
    def segment(seg) -> bool:
        return (isinstance(seg, list) and len(seg) == 3 and all(isinstance(n, int) and n >= 0 for n in seg[:2])
                and isinstance(seg[2], str))

    return isinstance(unit, dict) and all(segment(unit.get(s)) for s in ("train", "val")) and \
        isinstance(unit.get("pieces"), int)


def save_state(path: Path, state: dict) -> None:
    """The whole record, replaced at once (at the start, after a tokenizer is trained, after a cut-back)."""
    header = {k: v for k, v in state.items() if k != "units"}
    text = "".join(json.dumps(line) + "\n" for line in [header, *state["units"]])
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def append_unit(path: Path, unit: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(unit) + "\n")
        f.flush()
        os.fsync(f.fileno())


def shard_name(split: str, index: int, suffix: str = ".bin") -> str:
    return f"{split}-{index:05d}{suffix}"


def mask_name(split: str, index: int) -> str:
    """The mask file beside shard `index` (format.py: one uint8 of flags per token)."""
    return shard_name(split, index, MASK_SUFFIX)


def shard_table(split: str, segments: list[list], limit: int, masked: bool = False) -> list[dict]:
    """meta.json's shards of a split: file, tokens and documents (counted in the shard where each ends)."""
    total = sum(seg[0] for seg in segments)
    shards = [{"file": shard_name(split, k), "tokens": min(limit, total - k * limit), "documents": 0}
              for k in range(-(-total // limit))]
    if masked:
        for k, shard in enumerate(shards):
            shard["mask"] = mask_name(split, k)
    end = 0
    for tokens, documents, _ in segments:
        end += tokens
        if documents:
            shards[(end - 1) // limit]["documents"] += documents
    return shards


class SplitWriter:
    """Appends segments to one split's shard files (and their mask files when `masked`); `segments` is what
    the state records of it. A masked segment's sha256 covers its token bytes, then its mask bytes."""

    def __init__(self, root: Path, split: str, dtype: str, limit: int, vocab_size: int, masked: bool = False):
        self.root, self.split, self.dtype, self.limit = root, split, np.dtype(dtype), limit
        self.vocab_size, self.masked = vocab_size, masked
        self.tokens = 0  # written so far

    def append(self, ids: np.ndarray, documents: int, mask: np.ndarray | None = None) -> list:
        """Write `ids` (checked against the vocabulary and the width first) and its mask; returns its segment."""
        if self.masked != (mask is not None) or (mask is not None and mask.size != ids.size):
            raise ValueError(f"a mask of {None if mask is None else mask.size} flags for {ids.size} tokens "
                             f"(masked split: {self.masked})")
        data = self._narrowed(ids)
        digest = hashlib.sha256(data.tobytes())
        files = [(data, shard_name)]
        if mask is not None:
            flags = mask.astype(np.uint8)
            digest.update(flags.tobytes())
            files.append((flags, mask_name))
        for array, name in files:
            self._write(array, name)
        self.tokens += int(ids.size)
        return [int(ids.size), documents, digest.hexdigest()]

    def _write(self, data: np.ndarray, name) -> None:
        """Append `data` after the first `self.tokens` entries of the stream of files named by `name`."""
        position = self.tokens
        while data.size:
            index, offset = divmod(position, self.limit)
            room = self.limit - offset
            with (self.root / name(self.split, index)).open("ab") as f:
                f.write(data[:room].tobytes())
                f.flush()
                os.fsync(f.fileno())
            written = min(room, data.size)
            position += written
            data = data[written:]

    def _narrowed(self, ids: np.ndarray) -> np.ndarray:
        # astype wraps silently: an id the width cannot hold (or past the vocabulary meta.json states)
        # would become another, real token.
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            bad = int(ids.max()) if int(ids.max()) >= self.vocab_size else int(ids.min())
            raise DatasetError(f"the tokenizer produced token id {bad}, outside its vocabulary of {self.vocab_size} "
                               f"({self.dtype.name} tokens); its tokenizer.json is inconsistent: fix or replace it")
        return ids.astype(self.dtype)

    def cut_back(self, tokens: int) -> None:
        """The split as it was after its first `tokens` tokens: later bytes and later shard files removed."""
        self.tokens = tokens
        keep = -(-tokens // self.limit)
        kinds = [(".bin", self.dtype.itemsize)] + ([(MASK_SUFFIX, 1)] if self.masked else [])
        for suffix, itemsize in kinds:
            for k in range(keep):
                path = self.root / shard_name(self.split, k, suffix)
                with path.open("r+b" if path.exists() else "wb") as f:
                    f.truncate(min(self.limit, tokens - k * self.limit) * itemsize)
        for suffix in (".bin", MASK_SUFFIX):
            for stray in self.root.glob(f"{self.split}-*{suffix}"):
                index = stray.name[len(self.split) + 1:-len(suffix)]
                if not (index.isdigit() and int(index) < keep) or (suffix == MASK_SUFFIX and not self.masked):
                    stray.unlink()


def intact_units(root: Path, units: list[dict], dtype: str, limit: int, masked: bool = False) -> int:
    """How many of the recorded units, from the first, read back from the shards (and masks) byte for byte."""
    itemsize = np.dtype(dtype).itemsize
    readers = {split: [_StreamReader(root, split, limit, itemsize)]
               + ([_StreamReader(root, split, limit, 1, MASK_SUFFIX)] if masked else []) for split in ("train", "val")}
    for count, unit in enumerate(units):
        for split, streams in readers.items():
            tokens, _, sha = unit[split]
            digest = hashlib.sha256()
            if not all(stream.update(digest, tokens) for stream in streams) or digest.hexdigest() != sha:
                return count
    return len(units)


class _StreamReader:
    """A split's shard (or mask) files read in order as one stream of tokens."""

    def __init__(self, root: Path, split: str, limit: int, itemsize: int, suffix: str = ".bin"):
        self.root, self.split, self.limit, self.itemsize, self.suffix = root, split, limit, itemsize, suffix
        self.position = 0

    def update(self, digest, tokens: int) -> bool:
        """Feed the next `tokens` entries to `digest`; False when the files end (or are missing) before them."""
        end = self.position + tokens
        while self.position < end:
            index, offset = divmod(self.position, self.limit)
            count = min(self.limit - offset, end - self.position)
            if not self._read_into(digest, index, offset, count):
                return False
            self.position += count
        return True

    def _read_into(self, digest, index: int, offset: int, count: int) -> bool:
        try:
            with (self.root / shard_name(self.split, index, self.suffix)).open("rb") as f:
                f.seek(offset * self.itemsize)
                left = count * self.itemsize
                while left:
                    block = f.read(min(left, READ_BLOCK))
                    if not block:
                        return False
                    digest.update(block)
                    left -= len(block)
        except OSError:
            return False
        return True
