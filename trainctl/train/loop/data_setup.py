"""The worker's token data before the first batch: check the data settings, build the stdlib token cache,
open a split's token files and check their ids against the model's vocabulary.

Kept apart from the token sources (sources.py, which only read) and the batches (data.py, which only sample):
this is the part that writes files and refuses settings, run once per launch.

Three sources, chosen by `data.kind`:
- `stdlib`: this Python's standard library `.py` sources as byte-level tokens (ids 0..255). Each file is
  followed by one 0 byte as a document separator (0 never occurs in source text). Files are split into
  train/val by a crc32 of their relative path, tokenized once into `train.bin` / `val.bin` (uint16) and
  `meta.json` under `data.cache_dir/stdlib-py<version>-<fingerprint>/`.
- `memmap`: the user's own flat token files (`data.train_path`, `data.val_path`, `data.token_dtype`).
- `synthetic`: random tokens generated per sample from the (seed, step, sample) RNG; no file I/O.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import sysconfig
import tempfile
import zlib
from pathlib import Path

import numpy as np

from trainctl.config.schema import DATA_KINDS, TOKEN_DTYPES, DataConfig
from trainctl.train.loop.sources import BlendedTokens, DataError, FlatTokens, TokenSource, open_token_file

SEPARATOR = 0  # appended after every stdlib file; never occurs in Python source
STDLIB_VOCAB = 256  # byte-level tokens
CACHE_FORMAT = 1  # bump when the layout of the cached files changes
_CACHE_DTYPE = np.uint16
SPLITS = ("train", "val")
_VOCAB_SAMPLE_CHUNKS = 64
_VOCAB_SAMPLE_TOKENS = 1 << 16  # per chunk: check_vocab reads at most 64 x 64k tokens per file


# ---------------------------------------------------------------- config checks


def check_config(cfg: DataConfig) -> None:
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


def stdlib_sources(root: Path) -> dict[str, int]:
    """Relative POSIX path -> size of the stdlib's non-empty `.py` files, sorted by path; third-party packages
    excluded. One os.scandir walk (every rank of every run does it to check the cache: no Path per file)."""
    found: dict[str, int] = {}
    pending = [(str(root), "")]
    while pending:
        folder, prefix = pending.pop()
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=True):
                    if entry.name not in ("site-packages", "dist-packages"):
                        pending.append((entry.path, f"{prefix}{entry.name}/"))
                elif entry.name.endswith(".py") and entry.is_file(follow_symlinks=True):
                    size = entry.stat(follow_symlinks=True).st_size
                    if size > 0:
                        found[prefix + entry.name] = size
    return dict(sorted(found.items()))


def list_stdlib_sources(root: Path) -> list[str]:
    """Relative POSIX paths of the stdlib's non-empty `.py` files, sorted; third-party packages excluded."""
    return list(stdlib_sources(root))


def is_val_file(rel_path: str, val_fraction: float) -> bool:
    """Whether a stdlib file is held out; crc32 keeps the split stable across runs and machines."""
    return zlib.crc32(rel_path.encode("utf-8")) / 2**32 < val_fraction


def stdlib_cache_dir(cfg: DataConfig) -> Path:
    """Where this Python's stdlib tokens are cached: keyed so different Pythons and splits never collide."""
    key = f"{stdlib_root()}\0{sys.version}\0{cfg.val_fraction!r}\0{CACHE_FORMAT}"
    fingerprint = hashlib.sha1(key.encode("utf-8")).hexdigest()[:12]
    version = ".".join(str(v) for v in sys.version_info[:3])
    return Path(cfg.cache_dir).expanduser() / f"stdlib-py{version}-{fingerprint}"


def _sources_digest(sources: dict[str, int]) -> str:
    # Paths and sizes are enough to notice a reinstalled or patched stdlib without reading every file.
    h = hashlib.sha1()
    for rel, size in sources.items():
        h.update(f"{rel}\0{size}\n".encode())
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
    for split in SPLITS:
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
    sources = stdlib_sources(root)
    rel_paths = list(sources)
    if not rel_paths:
        raise DataError(f"data.kind=stdlib: no .py files under {root}; use data.kind=memmap or synthetic")
    digest = _sources_digest(sources)
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
    for split in SPLITS:
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


# ---------------------------------------------------------------- a split's files, checked


def open_split(cfg: DataConfig, split: str) -> tuple[TokenSource, str]:
    """The tokens of a split and the config key to blame for them."""
    if cfg.kind == "memmap" and cfg.datasets:
        return BlendedTokens.open(cfg.datasets, cfg.weights, split), "data.datasets"
    if cfg.kind == "memmap":
        key = f"data.{split}_path"
        path = cfg.train_path if split == "train" else cfg.val_path
        if not path:
            raise DataError(f"{key} is empty; data.kind=memmap needs a pre-tokenized token file")
        return FlatTokens(open_token_file(Path(path).expanduser(), cfg.token_dtype, key)), key
    cache = stdlib_cache_dir(cfg)
    if not _stdlib_cache_is_complete(cache, _read_meta(cache)):
        raise DataError(f"data.cache_dir={cfg.cache_dir!r}: no complete stdlib token cache at {cache}; "
                        "run prepare_data first")
    return FlatTokens(open_token_file(cache / f"{split}.bin", "uint16", "data.cache_dir")), "data.cache_dir"


def prepare_data(data_cfg: DataConfig) -> None:
    """Build and cache token files if needed, and check user files; idempotent, safe to run concurrently."""
    check_config(data_cfg)
    if data_cfg.kind == "stdlib":
        build_stdlib_cache(data_cfg)
    elif data_cfg.kind == "memmap":
        for split in SPLITS:
            open_split(data_cfg, split)


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
    check_config(data_cfg)
    data_vocab = STDLIB_VOCAB if data_cfg.kind == "stdlib" else data_cfg.vocab_size
    if data_vocab > model_vocab:
        raise DataError(f"model.vocab_size={model_vocab} is below data.vocab_size={data_vocab}; "
                        f"raise model.vocab_size to >= {data_vocab}")
    if data_cfg.kind != "memmap":
        return
    for split in SPLITS:
        tokens, key = open_split(data_cfg, split)
        largest = max((_sampled_max(array) for array in tokens.arrays() if array.size), default=-1)
        if largest >= data_cfg.vocab_size:
            raise DataError(f"{key}: token id {largest} >= data.vocab_size={data_cfg.vocab_size}; "
                            f"set data.vocab_size (and model.vocab_size) to > {largest}")
