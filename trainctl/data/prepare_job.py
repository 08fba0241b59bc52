"""One `data prepare` run inside its locked --out folder (data/prepare.py checks the arguments and the folder
first): the tokenizer, the units tokenized in worker processes and written in input order, the rebalancing of
an empty split, and meta.json last.

Separate from prepare.py so that the checks before anything is written and the work after it read apart; the
functions the worker processes run live here, at module level, where a process pool can find them.
"""

from __future__ import annotations

import json
import os
import signal
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from trainctl.data.chat import RecordOptions, count_loss_tokens, tokenize_records
from trainctl.data.format import (
    BYTES_FINGERPRINT,
    FORMAT,
    META_FILE,
    SPLITS,
    VERSION,
    DatasetError,
    dtype_for_vocab,
    read_meta,
    tokenizer_fingerprint,
)
from trainctl.data.inputs import Unit, documents, plan_units, sha256_of, unit_documents
from trainctl.data.outdir import LOCK_FILE, STATE_FILE, TOKENIZER_FILE, is_temporary
from trainctl.data.preference import tokenize_pairs
from trainctl.data.shards import SplitWriter, append_unit, intact_units, save_state, shard_table
from trainctl.data.split import stretches
from trainctl.data.tokenizer import TRAINED_EOS, ByteTokenizer, HFTokenizer, from_spec, train_bpe

ENCODE_BATCH = 256  # stretches of text per encode_batch call


# ---------------------------------------------------------------- one unit, in a worker process


_WORKER_TOKENIZER = None


def _init_worker(spec: dict) -> None:
    global _WORKER_TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # parallel over processes, not threads inside each
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle (and to stop us)
    _WORKER_TOKENIZER = from_spec(spec)


def tokenize_unit(unit: Unit, text_field: str, seed: int, val_fraction: float, tokenizer=None,
                  last_to: str | None = None) -> dict:
    """One unit's train and val tokens (each stretch of text between the tokenizer's prefix, BOS or nothing, and
    EOS), stretch and piece counts."""
    tok = tokenizer or _WORKER_TOKENIZER
    eos = np.asarray([tok.eos_id], dtype=np.uint32)
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    batch: list[tuple[str, str]] = []
    pieces = 0

    def flush() -> None:
        for (split, _), ids in zip(batch, tok.encode_batch([text for _, text in batch]), strict=True):
            parts[split] += [tok.prefix, ids.astype(np.uint32, copy=False), eos]
        batch.clear()

    texts = (text for text in unit_documents(unit, text_field) if text.strip())  # no lone EOS for blank text
    for split, text, count in stretches(texts, seed, val_fraction, last_to):
        pieces += count
        batch.append((split, text))
        if len(batch) >= ENCODE_BATCH:
            flush()
    flush()
    result = {s: np.concatenate(p) if p else np.zeros(0, np.uint32) for s, p in parts.items()}
    return {**result, "train_docs": len(parts["train"]) // 3, "val_docs": len(parts["val"]) // 3, "pieces": pieces}


def tokenize_record_unit(unit: Unit, options: RecordOptions, seed: int, val_fraction: float, tokenizer=None,
                         last_to: str | None = None) -> dict:
    """tokenize_unit for chat / instruction records: the same result, with each split's mask flags."""
    tokenize = tokenize_pairs if options.format == "preference" else tokenize_records
    return tokenize(unit, options, seed, val_fraction, tokenizer or _WORKER_TOKENIZER, last_to)


# ---------------------------------------------------------------- the whole job


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def _named(files: list[Path]) -> str:
    return f"{files[0]} (and {len(files) - 1} more)" if len(files) > 1 else str(files[0])


def input_listing(files: list[Path]) -> list:
    """(path, size, mtime) of each input: part of the arguments' fingerprint, and how a change mid-read shows."""
    return [(str(p), *_size_and_time(p)) for p in files]


def _size_and_time(path: Path) -> tuple[int, int] | tuple[None, None]:
    try:
        st = path.stat()
    except OSError:
        return None, None
    return st.st_size, st.st_mtime_ns


class Job:
    """One prepare into a locked --out, from a fresh or a saved state."""

    def __init__(self, out: Path, files: list[Path], listing: list, options: dict, workers: int | None, progress,
                 records: RecordOptions | None = None, names: list[str] | None = None):
        self.out, self.files, self.listing, self.options = out, files, listing, options
        self.workers, self.progress, self.records = workers, progress, records
        self.names = names or [str(p) for p in files]  # what meta.json's sources call them (prepare's input_names)

    def run(self, state: dict) -> object:
        self.state = state
        for stray in self.out.iterdir():  # half-written files of a run that died (a tokenizer, the record)
            if is_temporary(stray.name):
                stray.unlink()
        self._save()  # first: a folder with a record is an unfinished prepare that the same command finishes
        self.tok = self._tokenizer()
        try:
            dtype = dtype_for_vocab(self.tok.vocab_size)
        except DatasetError as exc:
            raise DatasetError(f"--tokenizer {self.options['tokenizer']}: {exc}") from None
        limit = self.options["shard_tokens"]
        masked = self.records is not None
        self.writers = {s: SplitWriter(self.out, s, dtype, limit, self.tok.vocab_size, masked) for s in SPLITS}
        units = plan_units(self.files, self.options["unit_bytes"])
        self._keep(min(intact_units(self.out, state["units"], dtype, limit, masked), len(units)))
        self._run(units, len(state["units"]))
        self._rebalance(units)
        if not self._tokens("train") and not self._tokens("val"):
            raise DatasetError(f"{_named(self.files)}: no text to train on (every input is empty)")
        changed = [Path(name) for (name, *was), (_, *now) in zip(self.listing, input_listing(self.files), strict=True)
                   if was != now]
        if changed:
            raise DatasetError(f"{_named(changed)}: changed while `data prepare` read it; run it again once the "
                               "inputs stay put")
        self._write_meta(dtype)
        (self.out / STATE_FILE).unlink()
        (self.out / LOCK_FILE).unlink()
        return read_meta(self.out)

    def _tokenizer(self):
        options = self.options
        if options["train_tokenizer"]:
            trained = self.out / TOKENIZER_FILE
            recorded = self.state.get("tokenizer_sha256")
            if recorded and trained.is_file() and sha256_of(trained) == recorded:
                return HFTokenizer(trained, kind="bpe", eos_token=TRAINED_EOS)
            self.state["units"] = []  # tokens made with a tokenizer that is gone are made again
            texts = (text for path in self.files for text in documents(path, options["text_field"]))
            tok = train_bpe(texts, options["vocab_size"], trained)
            self.state["tokenizer_sha256"] = sha256_of(trained)
            self._save()
            return tok
        if options["tokenizer"] == "bytes":
            return ByteTokenizer()
        return HFTokenizer(options["tokenizer"], eos_token=options["eos_token"], add_bos=options.get("bos"))

    def _save(self) -> None:
        save_state(self.out / STATE_FILE, self.state)

    def _keep(self, count: int) -> None:
        """The first `count` units stay; the splits are cut back to where they ended and the state says so."""
        units = self.state["units"][:count]
        for split, writer in self.writers.items():
            writer.cut_back(sum(u[split][0] for u in units))
        self.state["units"] = units
        self._save()

    def _tokens(self, split: str) -> int:
        return sum(u[split][0] for u in self.state["units"])

    def _run(self, units: list[Unit], start: int, last_to: tuple[int, str] | None = None) -> None:
        options = self.options
        task = tokenize_unit if self.records is None else tokenize_record_unit
        args = (options["text_field"] if self.records is None else self.records, options["seed"],
                options["val_fraction"])
        todo = list(range(start, len(units)))
        tracker = _Tracker(units, start, self.progress)
        workers = max(1, min(self.workers or os.cpu_count() or 1, len(todo) or 1))
        if workers == 1 or last_to is not None:
            for i in todo:
                forced = last_to[1] if last_to and last_to[0] == i else None
                self._add(task(units[i], *args, tokenizer=self.tok, last_to=forced))
                tracker.finished(i)
            return
        pool = ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(self.tok.spec(),))
        try:
            # A window of 2 units per worker: results are written in input order and memory stays bounded.
            window = 2 * workers
            waiting = deque(pool.submit(task, units[i], *args) for i in todo[:window])
            for n, i in enumerate(todo):
                result = waiting.popleft().result()
                if n + window < len(todo):
                    waiting.append(pool.submit(task, units[todo[n + window]], *args))
                self._add(result)
                tracker.finished(i)
        except BaseException:
            _stop(pool)  # Ctrl-C or a refusal: the units still running are not waited for
            raise
        pool.shutdown()

    def _add(self, result: dict) -> None:
        record = {split: self.writers[split].append(result[split], result[f"{split}_docs"], result.get(f"{split}_mask"))
                  for split in SPLITS}
        unit = {**record, "pieces": result["pieces"]}
        self.state["units"].append(unit)
        append_unit(self.out / STATE_FILE, unit)

    def _rebalance(self, units: list[Unit]) -> None:
        """A split that the hashes left empty gets the last piece: train unless all is held out (a one-piece
        corpus; --val-fraction 1 asks for an eval-only set), val when evaluation may read it and there are two
        pieces or more (a one-file corpus whose pieces all fell in train)."""
        done = self.state["units"]
        pieces = sum(u["pieces"] for u in done)
        if not self._tokens("train") and pieces and self.options["val_fraction"] < 1:
            split = "train"
        elif self.options["val_fraction"] > 0 and not self._tokens("val") and pieces >= 2:
            split = "val"
        else:
            return
        last = max(i for i, u in enumerate(done) if u["pieces"])
        self._keep(last)
        self._run(units, last, last_to=(last, split))

    def _write_meta(self, dtype: str) -> None:
        tok, options = self.tok, self.options
        tokenizer_file = None
        if tok.kind != "bytes":
            tokenizer_file = TOKENIZER_FILE
            if Path(tok.file) != self.out / TOKENIZER_FILE:
                (self.out / TOKENIZER_FILE).write_bytes(Path(tok.file).read_bytes())
        fingerprint = BYTES_FINGERPRINT if tok.kind == "bytes" else tokenizer_fingerprint(self.out / TOKENIZER_FILE)
        splits = {}
        for split in SPLITS:
            shards = shard_table(split, [u[split] for u in self.state["units"]], options["shard_tokens"],
                                 masked=self.records is not None)
            splits[split] = {"tokens": sum(s["tokens"] for s in shards),
                             "documents": sum(s["documents"] for s in shards), "shards": shards}
            if self.records is not None:  # what the loss sees: plan and users size epochs of answers by it
                splits[split]["loss_tokens"] = sum(count_loss_tokens(self.out / s["mask"]) for s in shards)
        if self.records is not None and splits["train"]["tokens"] and not splits["train"]["loss_tokens"]:
            raise DatasetError(empty_masks(self.records))
        meta = {
            "format": FORMAT, "version": VERSION,
            "tokenizer": {"kind": tok.kind, "file": tokenizer_file,
                          "source": options["tokenizer"] if tok.kind == "hf" else None,
                          "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "fingerprint": fingerprint,
                          **({"bos_id": tok.bos_id} if tok.prefix.size else {})},
            "token_dtype": dtype, "val_fraction": options["val_fraction"], "seed": options["seed"],
            "content": self.records.format if self.records else "text", "splits": splits,
            "sources": [{"path": name, "bytes": p.stat().st_size, "sha256": sha256_of(p)}
                        for p, name in zip(self.files, self.names, strict=True)],
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        if self.records is not None:
            meta["records"] = {k: v for k, v in self.records.__dict__.items() if k != "template"}
            if self.records.template is not None:
                meta["chat_template"] = self.records.template.record()
        _write_json(self.out / META_FILE, meta)


def empty_masks(records: RecordOptions) -> str:
    """Every loss mask empty: training would skip every step (nothing to learn) and still end COMPLETED."""
    why = ("the chat template renders no assistant text" if records.format == "chat"
           else "no completion text survives")
    cut = ", or --overlong truncate cut every answer at --max-doc-tokens" if records.overlong == "truncate" else ""
    return (f"--format {records.format}: no train token counts in the loss (every loss mask is empty: {why}{cut}); "
            "check the records, the --chat-template or --max-doc-tokens")


def _stop(pool: ProcessPoolExecutor) -> None:
    """Cancel what has not started and end the worker processes now (they ignore SIGINT)."""
    pool.shutdown(wait=False, cancel_futures=True)
    terminate = getattr(pool, "terminate_workers", None)  # Python 3.14
    if terminate is not None:
        terminate()
        return
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        process.terminate()
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        process.join(timeout=10)


class _Tracker:
    """Bytes of input done, for the progress callback."""

    def __init__(self, units: list[Unit], done: int, progress):
        self.units, self.total, self.progress = units, sum(u.size for u in units), progress
        self.done_bytes = sum(u.size for u in units[:done])
        self.report()

    def finished(self, index: int) -> None:
        self.done_bytes += self.units[index].size
        self.report()

    def report(self) -> None:
        if self.progress:
            self.progress(self.done_bytes, self.total)
