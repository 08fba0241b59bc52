"""`trainctl data prepare`: raw text in, a sharded token dataset out (data/format.py), resumable.

Inputs are files, folders (searched for .txt, .md, .jsonl, .parquet) and glob patterns (data/inputs.py).
A text file is one document; a .jsonl line or a .parquet row is one document (its `--text-field`). Pieces
of the input are tokenized in parallel (one process per core) and written in input order, so the output
does not depend on the number of workers. A document goes to the validation split when a hash of (seed, its text)
falls below `val_fraction`.

Resumable: after each piece the shards are flushed and `.prepare-state.json` records where every
shard ends. A run stopped by Ctrl-C or a crash continues from there when given the same arguments (the
shards are cut back to the recorded sizes first) and ends byte-identical to an uninterrupted run; other
arguments are refused. meta.json is written last; an existing dataset is never overwritten.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import struct
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from trainctl.data.format import FORMAT, META_FILE, SPLITS, VERSION, DatasetError, dtype_for_vocab, read_meta
from trainctl.data.inputs import UNIT_BYTES, Unit, documents, expand_inputs, plan_units, sha256_of, unit_documents
from trainctl.data.tokenizer import ByteTokenizer, HFTokenizer, from_spec, train_bpe

STATE_FILE = ".prepare-state.json"
LOCK_FILE = ".prepare.lock"  # flock-ed by the one `data prepare` writing the folder
TOKENIZER_FILE = "tokenizer.json"
DEFAULT_SHARD_TOKENS = 1 << 28  # 512 MiB of uint16 per shard
ENCODE_BATCH = 256  # documents per encode_batch call


# ---------------------------------------------------------------- one piece, in a worker process


def is_val(seed: int, text: str, val_fraction: float) -> bool:
    """A document's split from a hash of its text: the same wherever the files lie, and a duplicated
    document never lands on both sides."""
    digest = hashlib.blake2b(f"{seed}\0{text}".encode(), digest_size=8).digest()
    return struct.unpack("<Q", digest)[0] / 2**64 < val_fraction


_WORKER_TOKENIZER = None


def _init_worker(spec: dict) -> None:
    global _WORKER_TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # parallel over processes, not threads inside each
    _WORKER_TOKENIZER = from_spec(spec)


def tokenize_unit(unit: Unit, text_field: str, seed: int, val_fraction: float, tokenizer=None) -> dict:
    """One piece's train and val tokens (each document followed by EOS) and document counts."""
    tok = tokenizer or _WORKER_TOKENIZER
    eos = np.asarray([tok.eos_id], dtype=np.uint32)
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    count, last_train = 0, 0
    batch: list[str] = []

    def flush() -> None:
        nonlocal count, last_train
        for text, ids in zip(batch, tok.encode_batch(batch), strict=True):
            split = "val" if is_val(seed, text, val_fraction) else "train"
            parts[split] += [ids.astype(np.uint32), eos]
            if split == "train":
                last_train = len(ids) + 1
            count += 1
        batch.clear()

    for text in unit_documents(unit, text_field):
        if not text.strip():
            continue  # an empty document would be a lone EOS
        batch.append(text)
        if len(batch) >= ENCODE_BATCH:
            flush()
    flush()
    joined = {s: np.concatenate(p) if p else np.zeros(0, np.uint32) for s, p in parts.items()}
    val_docs = len(parts["val"]) // 2
    return {"train": joined["train"], "val": joined["val"], "train_docs": count - val_docs, "val_docs": val_docs,
            "last_train_tokens": last_train}


# ---------------------------------------------------------------- shard writing


class ShardWriter:
    """Appends tokens to `PREFIX-NNNNN.bin` files of at most `limit` tokens; its state resumes it exactly."""

    def __init__(self, root: Path, split: str, dtype: str, limit: int, state: dict | None = None):
        self.root, self.split, self.dtype, self.limit = root, split, np.dtype(dtype), limit
        self.shards: list[dict] = [dict(s) for s in (state or {}).get("shards", [])]
        self._cut_back()

    def _name(self, index: int) -> str:
        return f"{self.split}-{index:05d}.bin"

    def _cut_back(self) -> None:
        """Shards as the state recorded them: later bytes (a write that died) and later files removed."""
        for shard in self.shards:
            with (self.root / shard["file"]).open("r+b") as f:
                f.truncate(shard["tokens"] * self.dtype.itemsize)
        for stray in self.root.glob(f"{self.split}-*.bin"):
            if stray.name not in {s["file"] for s in self.shards}:
                stray.unlink()

    def append(self, tokens: np.ndarray, documents: int) -> None:
        data = tokens.astype(self.dtype)
        while data.size:
            if not self.shards or self.shards[-1]["tokens"] >= self.limit:
                self.shards.append({"file": self._name(len(self.shards)), "tokens": 0, "documents": 0})
                (self.root / self.shards[-1]["file"]).touch()
            shard = self.shards[-1]
            room = self.limit - shard["tokens"]
            with (self.root / shard["file"]).open("ab") as f:
                f.write(data[:room].tobytes())
                f.flush()
                os.fsync(f.fileno())
            shard["tokens"] += min(room, data.size)
            data = data[room:]
        if self.shards:
            self.shards[-1]["documents"] += documents  # counted where the document ends

    def state(self) -> dict:
        return {"shards": [dict(s) for s in self.shards]}


# ---------------------------------------------------------------- the whole job


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def _check_out(out: Path, fingerprint: str) -> dict | None:
    """The saved state of an unfinished run with these arguments, or None for a fresh folder; else refused."""
    if (out / META_FILE).exists():
        raise DatasetError(f"--out {out}: already a prepared dataset; choose another --out or delete it first")
    if out.exists() and not out.is_dir():
        raise DatasetError(f"--out {out}: is a file; choose a folder")
    if not out.exists() or not any(p.name != LOCK_FILE for p in out.iterdir()):
        return None
    state_file = out / STATE_FILE
    if not state_file.is_file():
        raise DatasetError(f"--out {out}: a non-empty folder that is not an unfinished `data prepare`; "
                           "choose an empty or new folder")
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError):
        raise DatasetError(f"{state_file}: damaged; delete {out} and prepare again") from None
    if state.get("fingerprint") != fingerprint:
        raise DatasetError(f"--out {out}: an unfinished `data prepare` with other inputs or options; "
                           "rerun it with its own arguments, or choose another --out")
    return state


def _fingerprint(files: list[Path], options: dict) -> str:
    listing = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return hashlib.sha256(json.dumps([listing, options], sort_keys=True).encode()).hexdigest()


def _tokenizer(out: Path, files: list[Path], options: dict, resumed: bool):
    if options["train_tokenizer"]:
        trained = out / TOKENIZER_FILE
        if resumed and trained.is_file():
            return HFTokenizer(trained, kind="bpe", eos_token=options["eos_token"] or "<|endoftext|>")
        texts = (text for path in files for text in documents(path, options["text_field"]))
        return train_bpe(texts, options["vocab_size"], trained)
    if options["tokenizer"] == "bytes":
        return ByteTokenizer()
    return HFTokenizer(options["tokenizer"], eos_token=options["eos_token"])


def prepare(inputs: list[str], out: str | Path, tokenizer: str = "bytes", train_tokenizer: bool = False,
            vocab_size: int | None = None, eos_token: str | None = None, text_field: str = "text",
            val_fraction: float = 0.01, shard_tokens: int = DEFAULT_SHARD_TOKENS, workers: int | None = None,
            seed: int = 0, progress: Callable[[int, int], None] | None = None, unit_bytes: int = UNIT_BYTES):
    """Tokenize `inputs` into a prepared dataset at `out`; returns its DatasetMeta."""
    if not 0 <= val_fraction < 1:
        raise DatasetError(f"--val-fraction {val_fraction}: use a fraction in [0, 1)")
    if shard_tokens < 1:
        raise DatasetError(f"--shard-tokens {shard_tokens}: use a positive number of tokens")
    if train_tokenizer and not vocab_size:
        raise DatasetError("--train-tokenizer needs --vocab-size N (e.g. 32000)")
    out = Path(out).expanduser().resolve()
    files = expand_inputs(inputs, out)
    options = {"tokenizer": tokenizer if tokenizer == "bytes" else str(Path(tokenizer).expanduser().resolve()),
               "train_tokenizer": train_tokenizer, "vocab_size": vocab_size, "eos_token": eos_token,
               "text_field": text_field, "val_fraction": val_fraction, "shard_tokens": shard_tokens, "seed": seed,
               "unit_bytes": unit_bytes}
    fingerprint = _fingerprint(files, options)
    _check_out(out, fingerprint)  # before anything is written
    existed = out.exists()
    out.mkdir(parents=True, exist_ok=True)
    lock = _lock(out)
    try:
        state = _check_out(out, fingerprint)  # again, now that no other `data prepare` can change it
    except DatasetError:
        lock.close()
        if not existed:
            shutil.rmtree(out, ignore_errors=True)
        raise
    with lock:
        return _prepare_locked(out, state, fingerprint, files, options, inputs, workers, progress)


def _lock(out: Path):
    """This process's exclusive hold on `out`: a second `data prepare` into it is refused at once."""
    handle = (out / LOCK_FILE).open("a")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise DatasetError(f"--out {out}: another `trainctl data prepare` is writing it; wait for it, "
                           "or choose another --out") from None
    return handle


def _prepare_locked(out: Path, state: dict | None, fingerprint: str, files: list[Path], options: dict,
                    inputs: list[str], workers: int | None, progress):
    if state is None:
        state = {"fingerprint": fingerprint, "done": 0, "splits": {}, "last_train": 0}
        _write_json(out / STATE_FILE, state)
    tok = _tokenizer(out, files, options, resumed=state["done"] > 0)
    dtype = dtype_for_vocab(tok.vocab_size)
    writers = {s: ShardWriter(out, s, dtype, options["shard_tokens"], state["splits"].get(s)) for s in SPLITS}
    units = plan_units(files, options["unit_bytes"])
    _run(units, state, writers, tok, options, workers, out, progress)
    if not any(s["tokens"] for s in writers["train"].shards):
        shutil.rmtree(out, ignore_errors=True)  # nothing was made: leave no half-dataset behind
        raise DatasetError(f"{', '.join(inputs)}: no text to train on (every input is empty)")
    _write_meta(out, tok, dtype, writers, files, options)
    (out / STATE_FILE).unlink()
    (out / LOCK_FILE).unlink()
    return read_meta(out)


def _run(units: list[Unit], state, writers, tok, options, workers, out, progress) -> None:
    args = (options["text_field"], options["seed"], options["val_fraction"])
    todo = list(range(state["done"], len(units)))
    total = sum(u.size for u in units)
    tracker = _Tracker(units, state["done"], total, progress)
    workers = max(1, min(workers or os.cpu_count() or 1, len(todo) or 1))
    if workers == 1:
        results = (tokenize_unit(units[i], *args, tokenizer=tok) for i in todo)
        _consume(todo, results, len(units), state, writers, out, tracker, options["val_fraction"])
        return
    with ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(tok.spec(),)) as pool:
        results = pool.map(tokenize_unit, [units[i] for i in todo], *([a] * len(todo) for a in args))
        _consume(todo, results, len(units), state, writers, out, tracker, options["val_fraction"])


class _Tracker:
    """Bytes of input done, for the progress callback."""

    def __init__(self, units: list[Unit], done: int, total: int, progress):
        self.units, self.total, self.progress = units, total, progress
        self.done_bytes = sum(u.size for u in units[:done])
        self.report()

    def finished(self, index: int) -> None:
        self.done_bytes += self.units[index].size
        self.report()

    def report(self) -> None:
        if self.progress:
            self.progress(self.done_bytes, self.total)


def _consume(todo, results, count: int, state, writers, out, tracker: _Tracker, val_fraction: float) -> None:
    # map keeps input order: the output does not depend on the number of workers.
    for i, result in zip(todo, results, strict=True):
        train, val, train_docs, val_docs = result["train"], result["val"], result["train_docs"], result["val_docs"]
        trained_before = sum(s["documents"] for s in writers["train"].shards)
        if (i == count - 1 and val_fraction > 0 and not val.size and _no_val(writers) and train_docs
                and trained_before + train_docs > 1):
            # Every document fell in train: the last one is held out, so eval has something to read.
            cut = train.size - result["last_train_tokens"]
            train, val, train_docs, val_docs = train[:cut], train[cut:], train_docs - 1, 1
        writers["train"].append(train, train_docs)
        writers["val"].append(val, val_docs)
        state.update(done=i + 1, splits={s: w.state() for s, w in writers.items()})
        _write_json(out / STATE_FILE, state)
        tracker.finished(i)


def _no_val(writers) -> bool:
    return not any(s["tokens"] for s in writers["val"].shards)


def _write_meta(out: Path, tok, dtype: str, writers: dict, files: list[Path], options: dict) -> None:
    tokenizer_file = None
    if tok.kind != "bytes":
        tokenizer_file = TOKENIZER_FILE
        if Path(tok.file) != out / TOKENIZER_FILE:
            (out / TOKENIZER_FILE).write_bytes(Path(tok.file).read_bytes())
    splits = {}
    for name, writer in writers.items():
        shards = writer.state()["shards"]
        splits[name] = {"tokens": sum(s["tokens"] for s in shards), "documents": sum(s["documents"] for s in shards),
                        "shards": shards}
    meta = {
        "format": FORMAT, "version": VERSION,
        "tokenizer": {"kind": tok.kind, "file": tokenizer_file,
                      "source": None if tok.kind == "bytes" else options["tokenizer"],
                      "vocab_size": tok.vocab_size, "eos_id": tok.eos_id},
        "token_dtype": dtype, "val_fraction": options["val_fraction"], "seed": options["seed"],
        "splits": splits,
        "sources": [{"path": str(p), "bytes": p.stat().st_size, "sha256": sha256_of(p)} for p in files],
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    _write_json(out / META_FILE, meta)
