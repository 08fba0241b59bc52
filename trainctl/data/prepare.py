"""`trainctl data prepare`: raw text in, a sharded token dataset out (data/format.py), resumable.

Inputs are files, folders (searched for .txt, .md, .jsonl, .parquet) and glob patterns (data/inputs.py).
A text file is one document; a .jsonl line or a .parquet row is one document (its `--text-field`; with
`--format chat|instruction` a record rendered with a loss mask, data/chat.py). Pieces
of the input (units) are tokenized in parallel (one process per core) and written in input order, so the
output does not depend on the number of workers. Long documents are cut into pieces and each piece goes
to train or val by a hash of its text (data/split.py); when every piece fell in train, the last one is
held out, so a one-file corpus still gets a val split.

Resumable: after each unit the shards are flushed and `.prepare-state.json` records what each split got
(tokens, documents, sha256; data/shards.py). A run stopped by Ctrl-C or a crash continues from there when
given the same arguments: what reads back intact is kept, the rest is done again, and it ends
byte-identical to an uninterrupted run; other arguments are refused. meta.json is written last; an
existing dataset is never overwritten, and a refused prepare leaves nothing behind (data/outdir.py).

The checks before anything is written (arguments, tokenizer file, the --out folder) are here; the run itself,
once the folder is locked, is data/prepare_job.py.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from trainctl.core import hub
from trainctl.data.chat import RecordOptions, resolve_options
from trainctl.data.format import MAX_VOCAB, META_FILE, DatasetError
from trainctl.data.inputs import UNIT_BYTES, expand_inputs, sha256_of
from trainctl.data.outdir import LOCK_FILE, STATE_FILE, TOKENIZER_FILE, OutFolder, is_temporary, out_path
from trainctl.data.prepare_job import Job, input_listing
from trainctl.data.shards import load_state
from trainctl.data.tokenizer import TRAINED_EOS

DEFAULT_SHARD_TOKENS = 1 << 28  # 512 MiB of uint16 per shard
MAX_SHARD_TOKENS = 1 << 40  # a shard file of at most 4 TiB


def _check_out(out: Path, fingerprint: str) -> dict | None:
    """The saved state of an unfinished run with these arguments, or None for a fresh folder; else refused."""
    if (out / META_FILE).exists():
        raise DatasetError(f"--out {out}: already a prepared dataset; choose another --out or delete it first")
    if not out.exists() or all(p.name == LOCK_FILE or is_temporary(p.name) for p in out.iterdir()):
        return None  # new, empty, or left by a prepare that died before it wrote its record
    state_file = out / STATE_FILE
    if not state_file.is_file():
        raise DatasetError(f"--out {out}: a non-empty folder that is not an unfinished `data prepare`; "
                           "choose an empty or new folder")
    try:
        state = load_state(state_file)
    except (OSError, ValueError):
        raise DatasetError(f"{state_file}: damaged; delete {out} and prepare again") from None
    if state.get("fingerprint") != fingerprint:
        raise DatasetError(f"--out {out}: an unfinished `data prepare` with other inputs or options; rerun it "
                           "with its own arguments, delete it to start over, or choose another --out")
    return state


def _named_listing(listing: list, names: list[str] | None) -> list:
    """The listing with each file's path replaced by its name (when its path is a temporary one)."""
    if names is None:
        return listing
    return [(name, *entry[1:]) for name, entry in zip(names, listing, strict=True)]


def _fingerprint(listing: list, options: dict) -> str:
    return hashlib.sha256(json.dumps([listing, options], sort_keys=True).encode()).hexdigest()


def _check_options(tokenizer: str, train_tokenizer: bool, vocab_size: int | None, eos_token: str | None,
                   val_fraction: float, shard_tokens: int, workers: int | None) -> None:
    if not 0 <= val_fraction <= 1:  # NaN fails too; 1: an eval-only set (trainctl eval --data DIR --all)
        raise DatasetError(f"--val-fraction {val_fraction}: use a fraction in [0, 1], e.g. 0.01 (1: eval only)")
    if not 1 <= shard_tokens <= MAX_SHARD_TOKENS:
        raise DatasetError(f"--shard-tokens {shard_tokens}: use a number of tokens from 1 to {MAX_SHARD_TOKENS}")
    if workers is not None and workers < 1:
        raise DatasetError(f"--workers {workers}: use a positive number of processes (default: one per core)")
    if train_tokenizer:
        if tokenizer != "bytes":
            raise DatasetError(f"--tokenizer {tokenizer} and --train-tokenizer: choose one")
        if not vocab_size:
            raise DatasetError("--train-tokenizer needs --vocab-size N (e.g. 32000)")
        if not vocab_size <= MAX_VOCAB:
            raise DatasetError(f"--vocab-size {vocab_size}: at most {MAX_VOCAB} (ids must fit uint32 tokens)")
        if eos_token not in (None, TRAINED_EOS):
            raise DatasetError(f"--eos-token {eos_token}: a trained tokenizer's end token is {TRAINED_EOS}; "
                               "leave --eos-token out")
    elif vocab_size is not None:
        raise DatasetError(f"--vocab-size {vocab_size}: only with --train-tokenizer (a given tokenizer has its own)")


def prepare(inputs: list[str], out: str | Path, tokenizer: str = "bytes", train_tokenizer: bool = False,
            vocab_size: int | None = None, eos_token: str | None = None, text_field: str = "text",
            val_fraction: float = 0.01, shard_tokens: int = DEFAULT_SHARD_TOKENS, workers: int | None = None,
            seed: int = 0, progress: Callable[[int, int], None] | None = None, unit_bytes: int = UNIT_BYTES,
            records: RecordOptions | None = None, chat_template: str | None = None, bos: bool | None = None,
            input_names: list[str] | None = None):
    """Tokenize `inputs` into a prepared dataset at `out`; returns its DatasetMeta.

    records: chat or instruction records (a loss mask beside the tokens); chat_template: --chat-template;
    bos: a beginning-of-text token before each text document (None: as the tokenizer's own config says);
    input_names: what the (sorted) input files are known by in the fingerprint and meta.json where their paths
    differ from run to run (a --hf export in a temporary folder), so the same command still resumes.
    """
    if bos is not None and records is not None and records.format != "text":
        raise DatasetError("--bos/--no-bos: for text documents; chat and instruction records get what their chat "
                           "template writes (its bos_token)")
    if bos and (train_tokenizer or tokenizer == "bytes"):
        raise DatasetError(f"--bos: {'a trained' if train_tokenizer else 'the bytes'} tokenizer has no "
                           "beginning-of-text token; leave --bos out, or use a model's tokenizer (--tokenizer DIR)")
    _check_options(tokenizer, train_tokenizer, vocab_size, eos_token, val_fraction, shard_tokens, workers)
    out = out_path(out)
    files = expand_inputs(inputs, out)
    given = _given_tokenizer(tokenizer)
    options = {"tokenizer": str(given or tokenizer), "train_tokenizer": train_tokenizer, "vocab_size": vocab_size,
               "eos_token": eos_token, "text_field": text_field, "val_fraction": val_fraction,
               "shard_tokens": shard_tokens, "seed": seed, "unit_bytes": unit_bytes,
               "tokenizer_sha256": _given_tokenizer_sha256(given, tokenizer)}
    records = resolve_options(records, chat_template, given, train_tokenizer, files)
    if bos is not None:  # only when given: a prepare without it keeps its fingerprint (its resume) as before
        options["bos"] = bos
    if records is not None:  # only then: a text prepare's fingerprint (its resume) is as before
        options["records"] = {**records.__dict__, "template": records.template and records.template.sha256}
    listing = input_listing(files)
    fingerprint = _fingerprint(_named_listing(listing, input_names), options)
    _check_out(out, fingerprint)  # before anything is written
    folder = OutFolder(out)
    folder.open()
    state = None
    try:
        state = _check_out(out, fingerprint)  # again, now that no other `data prepare` can change it
        job = Job(out, files, listing, options, workers, progress, records, input_names)
        return job.run(state or {"fingerprint": fingerprint, "tokenizer_sha256": None, "units": []})
    except DatasetError:
        if state is None:  # a fresh prepare refused: leave nothing behind
            folder.undo()
        raise
    except BrokenProcessPool:
        raise DatasetError(f"--out {out}: a tokenizing process died (out of memory?); run the same command again "
                           "to continue, with fewer --workers") from None
    except OSError as exc:  # a full disk, a folder removed under us: what was done is kept for a resume
        raise DatasetError(f"--out {out}: {exc.strerror or exc} ({exc.filename or out}); fix it and run the same "
                           "command again to continue") from None
    finally:
        folder.close()


def _given_tokenizer(tokenizer: str) -> Path | None:
    """--tokenizer as a file: a Hugging Face model folder (or a Hub name, through its cache) stands for its
    tokenizer.json."""
    if tokenizer == "bytes":
        return None
    try:
        folder = hub.resolve(tokenizer)
    except hub.HubError as exc:
        raise DatasetError(f"--tokenizer {exc}") from None
    given = Path(folder).expanduser().resolve()
    return given / TOKENIZER_FILE if (given / TOKENIZER_FILE).is_file() else given


def _given_tokenizer_sha256(given: Path | None, tokenizer: str) -> str | None:
    if given is None:
        return None
    if not given.is_file():
        what = "not a regular file" if given.exists() else "no such file"
        raise DatasetError(f"--tokenizer {tokenizer}: {what}; pass a Hugging Face tokenizer.json, or bytes")
    try:
        return sha256_of(given)
    except DatasetError as exc:
        raise DatasetError(f"--tokenizer {exc}") from None
