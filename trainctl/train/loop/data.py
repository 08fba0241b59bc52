"""The worker's token data: build the token files once, then serve batches as a pure function of (seed, step).

Three sources, chosen by `data.kind`:
- `stdlib`: this Python's standard library `.py` sources as byte-level tokens (ids 0..255). Each file is
  followed by one 0 byte as a document separator (0 never occurs in source text). Files are split into
  train/val by a crc32 of their relative path, tokenized once into `train.bin` / `val.bin` (uint16) and
  `meta.json` under `data.cache_dir/stdlib-py<version>-<fingerprint>/`.
- `memmap`: the user's own flat token files (`data.train_path`, `data.val_path`, `data.token_dtype`).
- `synthetic`: random tokens generated per sample from the (seed, step, sample) RNG; no file I/O.

Prepared chat / instruction datasets carry a mask file per shard (data/format.py): a window's targets whose
mask lacks the LOSS bit become IGNORE_INDEX, which the loss skips; datasets without masks count every target.

With `data.document_mask` each micro-batch also carries every input token's position in its document
(MicroBatch.positions): 0 at each DOC_START flag and at a row's first token (a row that starts inside a
document starts a segment there: its earlier tokens are outside the window). A target that begins the next
document is IGNORE_INDEX: no document learns to predict another one's first token.

Sampling: sample j (0 <= j < global_batch) of a step starts at the j-th offset drawn by
`np.random.default_rng([seed, step])`; rank r, micro-batch a, row b reads j = r*(A*M) + a*M + b. The union
over ranks and micro-batches is therefore the same global batch whatever the dp / accumulation split.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import sys
import sysconfig
import tempfile
import zlib
from pathlib import Path

import numpy as np
import torch

from trainctl.config.schema import DATA_KINDS, TOKEN_DTYPES, DataConfig
from trainctl.data.format import DOC_START, LOSS
from trainctl.models.loss_head import IGNORE_INDEX
from trainctl.train.errors import WorkerConfigError

SEPARATOR = 0  # appended after every stdlib file; never occurs in Python source
STDLIB_VOCAB = 256  # byte-level tokens
CACHE_FORMAT = 1  # bump when the layout of the cached files changes
_CACHE_DTYPE = np.uint16
_SPLITS = ("train", "val")
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
_VOCAB_SAMPLE_CHUNKS = 64
_VOCAB_SAMPLE_TOKENS = 1 << 16  # per chunk: check_vocab reads at most 64 x 64k tokens per file


class DataError(WorkerConfigError):  # exit 2, like any config error
    """A problem with the data that the user caused and can fix (message names the config key)."""


# ---------------------------------------------------------------- config checks


def _check_config(cfg: DataConfig) -> None:
    """Reject data settings that no source can serve, naming the key and what would work."""
    if cfg.kind not in DATA_KINDS:
        raise DataError(f"data.kind={cfg.kind!r} is unknown; use one of {', '.join(DATA_KINDS)}")
    if cfg.kind == "stdlib":
        if not 0.0 < cfg.val_fraction < 1.0:
            raise DataError(f"data.val_fraction={cfg.val_fraction} must be between 0 and 1 (exclusive); e.g. 0.05")
        if cfg.vocab_size < STDLIB_VOCAB:
            raise DataError(f"data.vocab_size={cfg.vocab_size} is below the stdlib corpus's {STDLIB_VOCAB} byte "
                            "tokens; use 256")
    if cfg.kind == "memmap" and not cfg.datasets:
        if cfg.token_dtype not in TOKEN_DTYPES:
            raise DataError(f"data.token_dtype={cfg.token_dtype!r} is unknown; use one of {', '.join(TOKEN_DTYPES)}")
        dtype_limit = np.iinfo(cfg.token_dtype).max + 1
        if cfg.vocab_size > dtype_limit:
            raise DataError(f"data.vocab_size={cfg.vocab_size} does not fit data.token_dtype={cfg.token_dtype}; "
                            "use uint32")
    if cfg.vocab_size < 1:
        raise DataError(f"data.vocab_size={cfg.vocab_size} must be >= 1")


# ---------------------------------------------------------------- stdlib corpus


def stdlib_root() -> Path:
    """The running Python's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def list_stdlib_sources(root: Path) -> list[str]:
    """Relative POSIX paths of the stdlib's non-empty `.py` files, sorted; third-party packages excluded."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages")]
        for name in filenames:
            path = Path(dirpath) / name
            if name.endswith(".py") and path.is_file() and path.stat().st_size > 0:
                found.append(path.relative_to(root).as_posix())
    return sorted(found)


def is_val_file(rel_path: str, val_fraction: float) -> bool:
    """Whether a stdlib file is held out; crc32 keeps the split stable across runs and machines."""
    return zlib.crc32(rel_path.encode("utf-8")) / 2**32 < val_fraction


def stdlib_cache_dir(cfg: DataConfig) -> Path:
    """Where this Python's stdlib tokens are cached: keyed so different Pythons and splits never collide."""
    key = f"{stdlib_root()}\0{sys.version}\0{cfg.val_fraction!r}\0{CACHE_FORMAT}"
    fingerprint = hashlib.sha1(key.encode("utf-8")).hexdigest()[:12]
    version = ".".join(str(v) for v in sys.version_info[:3])
    return Path(cfg.cache_dir).expanduser() / f"stdlib-py{version}-{fingerprint}"


def _sources_digest(root: Path, rel_paths: list[str]) -> str:
    # Paths and sizes are enough to notice a reinstalled or patched stdlib without reading every file.
    h = hashlib.sha1()
    for rel in rel_paths:
        h.update(f"{rel}\0{(root / rel).stat().st_size}\n".encode())
    return h.hexdigest()


def _write_atomically(path: Path, data: bytes) -> None:
    # A temp name in the same directory + os.replace: readers see the old file or the whole new one, and
    # two processes building at once both write identical content, so either rename may win.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a shared cache should be readable by others
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _read_meta(cache: Path) -> dict | None:
    try:
        return json.loads((cache / "meta.json").read_text())
    except (OSError, ValueError):
        return None


def _stdlib_cache_is_complete(cache: Path, meta: dict | None) -> bool:
    """Whether meta.json exists, matches this cache format, and the token files have the recorded sizes."""
    if meta is None or meta.get("format") != CACHE_FORMAT or meta.get("dtype") != "uint16":
        return False
    itemsize = np.dtype(_CACHE_DTYPE).itemsize
    for split in _SPLITS:
        path = cache / f"{split}.bin"
        if not path.is_file() or path.stat().st_size != meta["tokens"][split] * itemsize:
            return False
    return True


def _tokenize_files(root: Path, rel_paths: list[str]) -> bytes:
    """Byte tokens of the files, each followed by the separator."""
    sep = bytes([SEPARATOR])
    return b"".join((root / rel).read_bytes() + sep for rel in rel_paths)


def build_stdlib_cache(cfg: DataConfig) -> Path:
    """Tokenize the stdlib into the cache unless a complete, matching cache is there; returns its directory."""
    root, cache = stdlib_root(), stdlib_cache_dir(cfg)
    rel_paths = list_stdlib_sources(root)
    if not rel_paths:
        raise DataError(f"data.kind=stdlib: no .py files under {root}; use data.kind=memmap or synthetic")
    digest = _sources_digest(root, rel_paths)
    meta = _read_meta(cache)
    if _stdlib_cache_is_complete(cache, meta) and meta.get("sources_digest") == digest:
        return cache
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        message = f"data.cache_dir={cfg.cache_dir!r} is not writable ({e.strerror}); set a writable directory"
        raise DataError(message) from e
    held_out = {p for p in rel_paths if is_val_file(p, cfg.val_fraction)}
    split_files = {"train": [p for p in rel_paths if p not in held_out], "val": [p for p in rel_paths if p in held_out]}
    for split, files in split_files.items():
        if not files:
            raise DataError(f"data.val_fraction={cfg.val_fraction} leaves no {split} files; use a value like 0.05")
    tokens = {}
    for split in _SPLITS:
        array = np.frombuffer(_tokenize_files(root, split_files[split]), dtype=np.uint8).astype(_CACHE_DTYPE)
        tokens[split] = int(array.size)
        _write_atomically(cache / f"{split}.bin", array.tobytes())
    meta = {
        "format": CACHE_FORMAT,
        "dtype": "uint16",
        "vocab_size": STDLIB_VOCAB,
        "separator": SEPARATOR,
        "tokens": tokens,
        "files": {split: len(files) for split, files in split_files.items()},
        "val_fraction": cfg.val_fraction,
        "stdlib": str(root),
        "python_version": sys.version,
        "sources_digest": digest,
    }
    # meta.json goes last: it is the commit marker that says both token files are complete.
    _write_atomically(cache / "meta.json", (json.dumps(meta, indent=2) + "\n").encode())
    return cache


# ---------------------------------------------------------------- token files


def _open_token_file(path: Path, dtype: str, key: str) -> np.ndarray:
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


def _open_split(cfg: DataConfig, split: str) -> tuple[TokenSource, str]:
    """The tokens of a split and the config key to blame for them."""
    if cfg.kind == "memmap" and cfg.datasets:
        return BlendedTokens.open(cfg.datasets, cfg.weights, split), "data.datasets"
    if cfg.kind == "memmap":
        key = f"data.{split}_path"
        path = cfg.train_path if split == "train" else cfg.val_path
        if not path:
            raise DataError(f"{key} is empty; data.kind=memmap needs a pre-tokenized token file")
        return FlatTokens(_open_token_file(Path(path).expanduser(), cfg.token_dtype, key)), key
    cache = stdlib_cache_dir(cfg)
    if not _stdlib_cache_is_complete(cache, _read_meta(cache)):
        raise DataError(f"data.cache_dir={cfg.cache_dir!r}: no complete stdlib token cache at {cache}; "
                        "run prepare_data first")
    return FlatTokens(_open_token_file(cache / f"{split}.bin", "uint16", "data.cache_dir")), "data.cache_dir"


def prepare_data(data_cfg: DataConfig) -> None:
    """Build and cache token files if needed, and check user files; idempotent, safe to run concurrently."""
    _check_config(data_cfg)
    if data_cfg.kind == "stdlib":
        build_stdlib_cache(data_cfg)
    elif data_cfg.kind == "memmap":
        for split in _SPLITS:
            _open_split(data_cfg, split)


def _sampled_max(tokens: np.ndarray) -> int:
    """Largest token id in evenly spaced chunks of the array (all of it when small)."""
    if tokens.size <= _VOCAB_SAMPLE_CHUNKS * _VOCAB_SAMPLE_TOKENS:
        return int(tokens.max())
    starts = np.linspace(0, tokens.size - _VOCAB_SAMPLE_TOKENS, _VOCAB_SAMPLE_CHUNKS).astype(np.int64)
    return max(int(tokens[s : s + _VOCAB_SAMPLE_TOKENS].max()) for s in starts)


def check_vocab(data_cfg: DataConfig, model_vocab: int) -> None:
    """Fail early if the data can hold token ids the model cannot embed; reads a bounded sample of files.

    Cheap enough for every launch (at most a few MB per file). Batches are also checked against
    `data.vocab_size` as they are read, so an id the sample missed still fails with a DataError.
    """
    _check_config(data_cfg)
    data_vocab = STDLIB_VOCAB if data_cfg.kind == "stdlib" else data_cfg.vocab_size
    if data_vocab > model_vocab:
        raise DataError(f"model.vocab_size={model_vocab} is below data.vocab_size={data_vocab}; "
                        f"raise model.vocab_size to >= {data_vocab}")
    if data_cfg.kind != "memmap":
        return
    for split in _SPLITS:
        tokens, key = _open_split(data_cfg, split)
        largest = max((_sampled_max(array) for array in tokens.arrays() if array.size), default=-1)
        if largest >= data_cfg.vocab_size:
            raise DataError(f"{key}: token id {largest} >= data.vocab_size={data_cfg.vocab_size}; "
                            f"set data.vocab_size (and model.vocab_size) to > {largest}")


def _open_mask_file(path: Path, tokens: int, key: str) -> np.ndarray:
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
            shards = [_open_token_file(p, meta.token_dtype, key) for p in meta.shard_paths(split)]
            masks = meta.mask_paths(split)
            if masks is not None:
                masks = [_open_mask_file(m, shard.size, key) for m, shard in zip(masks, shards, strict=True)]
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


# ---------------------------------------------------------------- batches


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


def _to_inputs_targets(samples: np.ndarray, flags: np.ndarray | None = None,
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
                 grad_accum: int, dp_rank: int, dp_size: int, seed: int):
        assert split in _SPLITS, split
        assert global_batch == micro_batch * grad_accum * dp_size, (global_batch, micro_batch, grad_accum, dp_size)
        assert 0 <= dp_rank < dp_size and seq_len >= 1, (dp_rank, dp_size, seq_len)
        _check_config(data_cfg)
        if seed < 0:
            raise DataError(f"train.seed={seed} must be >= 0 (it seeds numpy's batch sampler)")
        self.split, self.seq_len, self.seed = split, seq_len, seed
        self.global_batch, self.micro_batch, self.grad_accum = global_batch, micro_batch, grad_accum
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self._base_step = self._base_sample = 0  # see resume_at
        self.vocab_size = STDLIB_VOCAB if data_cfg.kind == "stdlib" else data_cfg.vocab_size
        self.document_mask = data_cfg.document_mask
        self._tokens: TokenSource | None = None  # None: synthetic
        if data_cfg.kind == "synthetic" and self.document_mask:
            raise DataError("data.document_mask=true: synthetic data has no documents; use prepared chat datasets")
        if data_cfg.kind != "synthetic":
            self._tokens, self._key = _open_split(data_cfg, split)
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
        return self._base_sample + (step - self._base_step) * self.global_batch

    def sample_ids(self, step: int) -> list[range]:
        """The stream indices of this rank's `grad_accum` micro-batches of `step` (what micro_batches reads)."""
        assert step >= self._base_step, (step, self._base_step)
        first_of_rank = self.first_sample(step) + self.dp_rank * self.grad_accum * self.micro_batch
        return [range(first_of_rank + a * self.micro_batch, first_of_rank + (a + 1) * self.micro_batch)
                for a in range(self.grad_accum)]

    def micro_batches(self, step: int) -> list[MicroBatch]:
        """This rank's `grad_accum` (inputs, targets) pairs of shape [micro_batch, seq_len] for `step`."""
        ids = self.sample_ids(step)
        first_of_rank = ids[0].start
        starts = self._sample_starts(first_of_rank, self.grad_accum * self.micro_batch)
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
        return _to_inputs_targets(samples, flags, self.document_mask)
