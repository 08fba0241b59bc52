"""The prepared token dataset on disk, read without torch or numpy (the launcher checks it on a login node).

A prepared dataset is a folder written by `trainctl data prepare`:

    meta.json                     written last: its presence means the folder is complete
    train-00000.bin, ...          flat token ids (uint16 when the vocabulary fits, else uint32), native order
    train-00000.mask, ...         chat / instruction data only (version 2): one uint8 per token of the .bin
                                  beside it: bit 0 (LOSS) set where the token is a target that counts in the
                                  loss, bit 1 (DOC_START) set on the first token of every document
    val-00000.bin, ...            (and val-00000.mask, ...)
    tokenizer.json                when the tokenizer is a Hugging Face one (given or trained)

Every document is followed by the tokenizer's EOS id (a long document cut for the split: each stretch of it
that a split holds). meta.json records the tokenizer (with a fingerprint of what decides its ids), the token
width, each shard's tokens and documents, the train/val split and the source files (size, sha256).

Version 2 adds `content` (text | chat | instruction | preference) and, for record data, a mask file per
shard (`"mask"` in its shard entry). Reading them: `np.memmap(mask_file, np.uint8)` lines up with the
shard's tokens; `flags & LOSS` is the loss mask (token i counts when it is predicted from tokens < i), and
`np.flatnonzero(flags & DOC_START)` are the documents' first tokens, so document d spans
[starts[d], starts[d+1]) of the split's stream: what block-causal attention needs. Version 1 datasets
(text only, no masks) still load; their documents end at each EOS.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

META_FILE = "meta.json"
FORMAT = "trainctl-tokens"
VERSION = 2
READABLE_VERSIONS = (1, 2)  # version 1: written before masks; the same layout without them
LOSS = 1  # mask bit: the token is a target that counts in the loss
DOC_START = 2  # mask bit: the first token of a document
REJECTED = 4  # mask bit: the first token of a preference pair's rejected document (data/preference.py)
CONTENTS = ("text", "chat", "instruction", "preference")  # what a dataset holds: the record formats prepare reads
ITEMSIZE = {"uint16": 2, "uint32": 4}
SPLITS = ("train", "val")
MAX_VOCAB = 1 << 32  # ids 0 .. 2**32-1: what the widest token width (uint32) holds
# The byte tokenizer has no tokenizer.json: its ids are UTF-8 bytes and 0 ends a document, always.
BYTES_FINGERPRINT = "bytes:utf-8,eos=0"


class DatasetError(Exception):
    """A problem with the user's data or options; the message is one line naming it and what would work."""


@dataclass(frozen=True)
class Shard:
    file: str
    tokens: int
    documents: int
    mask: str | None = None  # the shard's mask file (chat / instruction data), one uint8 per token


@dataclass(frozen=True)
class Split:
    tokens: int
    documents: int
    shards: tuple[Shard, ...]
    loss_tokens: int | None = None  # masked data: the tokens that count in the loss


@dataclass(frozen=True)
class TokenizerInfo:
    kind: str  # bytes | hf | bpe (trained here)
    file: str | None  # tokenizer.json inside the dataset folder
    source: str | None  # what the user named
    vocab_size: int  # largest id + 1
    eos_id: int
    fingerprint: str | None = None  # tokenizer_fingerprint(); None when it cannot be known (no tokenizer.json)


@dataclass(frozen=True)
class DatasetMeta:
    root: Path
    tokenizer: TokenizerInfo
    token_dtype: str
    splits: dict[str, Split]
    sources: tuple[dict, ...]
    val_fraction: float
    content: str = "text"

    @property
    def masked(self) -> bool:
        """Whether its shards have mask files (only some tokens count in the loss)."""
        return any(shard.mask for split in self.splits.values() for shard in split.shards)

    def shard_paths(self, split: str) -> list[Path]:
        return [self.root / shard.file for shard in self.splits[split].shards]

    def mask_paths(self, split: str) -> list[Path] | None:
        """The split's mask files in shard order, or None for a dataset without masks."""
        if not self.masked:
            return None
        return [self.root / shard.mask for shard in self.splits[split].shards]


def dtype_for_vocab(vocab_size: int) -> str:
    """The narrowest token width that holds every id below `vocab_size` (the largest id + 1)."""
    if vocab_size > MAX_VOCAB:
        raise DatasetError(f"token id {vocab_size - 1} does not fit the widest token width (uint32, ids below "
                           f"{MAX_VOCAB}); use a tokenizer whose ids are below {MAX_VOCAB}")
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def tokenizer_fingerprint(path: str | Path) -> str:
    """sha256 over what decides a tokenizer.json's ids: its model (type, vocab, merges, ...), its added tokens
    with their ids, its normalizer and pre-tokenizer. Read with json only (the launcher side has no
    `tokenizers`); the same tokenizer saved by another library version gives the same fingerprint.

    Raises OSError or ValueError for a file that is missing or not a tokenizer.json (never blocks on a FIFO).
    """
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path}: not a regular file")
    return _fingerprint_of(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _fingerprint_of(path: str, size: int, mtime_ns: int) -> str:
    try:
        data = json.loads(Path(path).read_bytes())
    except RecursionError:
        raise ValueError("nested too deeply: not a Hugging Face tokenizer.json") from None
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise ValueError("no model section: not a Hugging Face tokenizer.json")
    model = dict(data["model"])
    if isinstance(model.get("merges"), list):  # "a b" (older files) and ["a", "b"] (newer) are the same merge
        model["merges"] = [m.split(" ", 1) if isinstance(m, str) else m for m in model["merges"]]
    added = sorted((t for t in data.get("added_tokens") or [] if isinstance(t, dict)), key=lambda t: str(t.get("id")))
    decisive = {"model": model, "added_tokens": added, "normalizer": data.get("normalizer"),
                "pre_tokenizer": data.get("pre_tokenizer")}
    text = json.dumps(decisive, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def read_meta(path: str | Path) -> DatasetMeta:
    """The dataset's meta.json, checked; a DatasetError (one line) when it is not a complete prepared dataset."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise DatasetError(f"{path}: no such folder; make a dataset with `trainctl data prepare TEXT... --out DIR`")
    if not (root / META_FILE).is_file():
        raise DatasetError(f"{path}: not a prepared dataset (no {META_FILE}); make one with `trainctl data prepare`"
                           " (a folder without it is an unfinished one: run the same command again to finish it)")
    try:
        data = json.loads((root / META_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise DatasetError(f"{root / META_FILE}: unreadable ({exc}); prepare the dataset again") from None
    try:
        return _parse(root.resolve(), data)
    except (KeyError, TypeError, ValueError) as exc:
        versions = "/".join(f"v{v}" for v in READABLE_VERSIONS)
        raise DatasetError(f"{root / META_FILE}: not a {FORMAT} {versions} file ({type(exc).__name__}: {exc}); "
                           "prepare the dataset again") from None


def _parse(root: Path, data: dict) -> DatasetMeta:
    if data["format"] != FORMAT or data["version"] not in READABLE_VERSIONS:
        raise ValueError(f"format {data.get('format')!r} version {data.get('version')!r}")
    if data["token_dtype"] not in ITEMSIZE:
        raise ValueError(f"token_dtype {data['token_dtype']!r}")
    tok = data["tokenizer"]
    tokenizer = TokenizerInfo(str(tok["kind"]), tok.get("file"), tok.get("source"), int(tok["vocab_size"]),
                              int(tok["eos_id"]), tok.get("fingerprint") or _stored_fingerprint(root, tok))
    splits = {}
    for name in SPLITS:
        item = data["splits"][name]
        shards = tuple(Shard(str(s["file"]), int(s["tokens"]), int(s["documents"]),
                             str(s["mask"]) if s.get("mask") else None) for s in item["shards"])
        loss_tokens = int(item["loss_tokens"]) if item.get("loss_tokens") is not None else None
        splits[name] = Split(int(item["tokens"]), int(item["documents"]), shards, loss_tokens)
    content = str(data.get("content", "text"))
    if content not in CONTENTS:
        raise ValueError(f"content {content!r}")
    meta = DatasetMeta(root, tokenizer, data["token_dtype"], splits, tuple(data.get("sources", ())),
                       float(data.get("val_fraction", 0.0)), content)
    masks = [shard.mask is not None for split in splits.values() for shard in split.shards]
    if any(masks) and not all(masks):
        raise ValueError("some shards have a mask file and some do not")
    return meta


def _stored_fingerprint(root: Path, tok: dict) -> str | None:
    """The fingerprint of a dataset written before meta.json recorded it: from its own tokenizer.json."""
    if tok["kind"] == "bytes":
        return BYTES_FINGERPRINT
    if not tok.get("file"):
        return None
    try:
        return tokenizer_fingerprint(root / str(tok["file"]))
    except (OSError, ValueError):
        return None


def dataset_problems(path: str | Path, split: str, vocab_size: int, seq_len: int,
                     key: str = "data.datasets") -> list[str]:
    """Every problem of a split of a prepared dataset, one line each; sizes only (instant on any size)."""
    head = f"{key}: {path}"
    try:
        meta = read_meta(path)
    except DatasetError as exc:
        return [f"{key}: {exc}"]
    problems = []
    if meta.tokenizer.vocab_size > vocab_size:
        problems.append(f"{head}: its tokenizer's vocabulary {meta.tokenizer.vocab_size} exceeds model.vocab_size "
                        f"{vocab_size}; use a model with vocab_size >= {meta.tokenizer.vocab_size}")
    itemsize = ITEMSIZE[meta.token_dtype]
    for shard in meta.splits[split].shards:
        where = meta.root / shard.file
        try:
            size = where.stat().st_size
        except OSError:
            problems.append(f"{head}: shard {shard.file} is missing; prepare the dataset again")
            continue
        if size != shard.tokens * itemsize:
            problems.append(f"{head}: shard {shard.file} is {size} bytes, meta.json says {shard.tokens} "
                            f"{meta.token_dtype} tokens ({shard.tokens * itemsize} bytes); prepare it again")
        if shard.mask:
            problems += _mask_problems(head, meta.root / shard.mask, shard)
    problems += _split_size_problems(head, meta, split, seq_len) + _no_loss_problems(head, meta, split)
    return problems


def _no_loss_problems(head: str, meta: DatasetMeta, split: str) -> list[str]:
    """Masked data whose split has tokens but none that counts in the loss (meta.json's loss_tokens): training
    would skip every step, evaluation would report a nan loss (0 / 0)."""
    counted = meta.splits[split].loss_tokens
    if not meta.masked or counted is None or counted > 0 or not meta.splits[split].tokens:
        return []
    if split == "train":
        return [f"{head}: no train token counts in the loss (every loss mask is empty), so every step would be "
                "skipped; prepare it again from records with answers"]
    return [f"{head}: no val token counts in the loss (every val loss mask is empty), so the val loss would be nan; "
            "prepare it with a larger --val-fraction, or set train.eval_every=0"]


def _mask_problems(head: str, where: Path, shard: Shard) -> list[str]:
    """A mask file must hold one byte per token of its shard: any other length would shift every mask."""
    try:
        size = where.stat().st_size
    except OSError:
        return [f"{head}: mask {shard.mask} of shard {shard.file} is missing; prepare the dataset again"]
    if size != shard.tokens:
        return [f"{head}: mask {shard.mask} is {size} bytes, its shard {shard.file} has {shard.tokens} tokens "
                "(one mask byte each); prepare the dataset again"]
    return []


def _split_size_problems(head: str, meta: DatasetMeta, split: str, seq_len: int) -> list[str]:
    tokens = meta.splits[split].tokens
    if tokens == 0 and split == "val":
        return [f"{head}: its val split is empty (prepared with --val-fraction {meta.val_fraction:g}), and evaluation "
                "reads it; prepare it again with --val-fraction 0.01 (or more), or set train.eval_every=0"]
    if tokens == 0 and meta.val_fraction >= 1:
        return [f"{head}: an eval-only set (prepared with --val-fraction 1): it has no train split; evaluate with "
                f"`trainctl eval RUN --data {meta.root} --all`, and train on another dataset"]
    if tokens == 0:
        return [f"{head}: its train split is empty; prepare it again with more text"]
    if tokens < seq_len + 1:
        more = "raise --val-fraction, set train.eval_every=0, " if split == "val" else "add text "
        return [f"{head}: its {split} split has {tokens} tokens, fewer than train.seq_len+1={seq_len + 1}; "
                f"{more}or lower train.seq_len"]
    return []
