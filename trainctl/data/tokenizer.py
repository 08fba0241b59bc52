"""Tokenizers behind one small interface: raw bytes, a Hugging Face tokenizer.json, or a BPE trained here.

The `tokenizers` library (what every Llama on the Hub ships a tokenizer.json for) is imported only
when a Hugging Face tokenizer is used or trained.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from trainctl.core.rundir import read_bytes
from trainctl.data.format import DatasetError

BYTES_VOCAB = 256
BYTES_EOS = 0  # NUL: removed from the text, so it appears only between documents
# End-of-document tokens of common tokenizers, tried in order when --eos-token is not given and the tokenizer's
# folder names none in its tokenizer_config.json.
EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<|eot_id|>", "<eos>", "<|im_end|>")
TRAINED_EOS = "<|endoftext|>"
TOKENIZER_CONFIG = "tokenizer_config.json"
MAX_CONFIG_BYTES = 64 << 20  # a tokenizer_config.json with a long chat template is a few hundred KB


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise DatasetError("this tokenizer needs the `tokenizers` library: pip install tokenizers "
                           "(or pip install 'trainctl[data]')") from None
    return tokenizers


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 (the demo's tokenizer); NUL is the end-of-document id."""

    kind, vocab_size, eos_id, file = "bytes", BYTES_VOCAB, BYTES_EOS, None
    prefix = np.zeros(0, dtype=np.uint32)  # no beginning-of-text token: nothing before a document

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.replace("\0", "").encode("utf-8", "replace"), dtype=np.uint8) for t in texts]

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids, [n, 2] character spans): each byte of a character carries that character's span."""
        ids = self.encode_batch([text])[0]
        lengths = np.asarray([0 if c == "\0" else len(c.encode("utf-8", "replace")) for c in text], dtype=np.int64)
        chars = np.repeat(np.arange(len(text), dtype=np.int64), lengths)
        return ids.astype(np.uint32), np.stack([chars, chars + 1], axis=1)

    def spec(self) -> dict:
        return {"kind": self.kind}


def folder_config(tokenizer_file: str | Path) -> dict:
    """The tokenizer_config.json beside a tokenizer.json (its special tokens, add_bos_token), or {}."""
    raw = read_bytes(Path(tokenizer_file).parent / TOKENIZER_CONFIG, MAX_CONFIG_BYTES)
    try:
        data = json.loads(raw) if raw is not None else {}
    except (ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def special_token(config: dict, key: str) -> str | None:
    """tokenizer_config.json's `key` (eos_token, bos_token): a string or an AddedToken-shaped {"content": ...}."""
    value = config.get(key)
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) and value else None


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (the `tokenizers` library); encodes without adding special tokens.

    `add_bos`: put the beginning-of-text token before each text document (None: as the folder's
    tokenizer_config.json says: its add_bos_token, else whether it names a bos_token)."""

    def __init__(self, path: str | Path, kind: str = "hf", eos_token: str | None = None,
                 add_bos: bool | None = None):
        self.kind, self.file = kind, str(Path(path).expanduser().resolve())
        if not Path(self.file).is_file():
            raise DatasetError(f"--tokenizer {path}: no such file; pass a Hugging Face tokenizer.json")
        try:
            self._tok = _tokenizers().Tokenizer.from_file(self.file)
        except Exception as exc:  # the library raises plain Exceptions for a bad file
            raise DatasetError(f"--tokenizer {path}: not a Hugging Face tokenizer.json ({exc})") from None
        # The largest id + 1, not the number of tokens: ids may be sparse (a token at 70000 among five).
        self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        if self.vocab_size < 1:
            raise DatasetError(f"--tokenizer {path}: a tokenizer.json without tokens; pass a complete one")
        config = folder_config(self.file) if kind == "hf" else {}
        self.eos_token, self.eos_id = self._find_eos(eos_token, path, special_token(config, "eos_token"))
        self.add_bos = self._bos(add_bos, config, path)
        self.prefix = np.asarray([self.bos_id] if self.add_bos else [], dtype=np.uint32)

    def _bos(self, add_bos: bool | None, config: dict, path) -> bool:
        """Whether text documents start with the bos token; sets bos_token and bos_id (None when there is none)."""
        self.bos_token = special_token(config, "bos_token")
        self.bos_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        if add_bos is None:
            wanted = config.get("add_bos_token")
            return self.bos_id is not None and (wanted if isinstance(wanted, bool) else True)
        if add_bos and self.bos_id is None:
            raise DatasetError(f"--bos: {path} has no beginning-of-text token (no bos_token of its vocabulary in "
                               f"{TOKENIZER_CONFIG} beside it); leave --bos out, or use the model's tokenizer folder")
        return add_bos

    def _find_eos(self, eos_token: str | None, path, configured: str | None) -> tuple[str, int]:
        # The folder's own eos_token comes first; the built-in list is for a bare tokenizer.json.
        for candidate in [eos_token] if eos_token else [configured, *EOS_CANDIDATES] if configured else EOS_CANDIDATES:
            token_id = self._tok.token_to_id(candidate)
            if token_id is not None:
                return candidate, token_id
        if eos_token:
            raise DatasetError(f"--eos-token {eos_token}: not a token of {path}")
        raise DatasetError(f"--tokenizer {path}: no end-of-document token among {', '.join(EOS_CANDIDATES)}; "
                           "name it with --eos-token TOKEN")

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.uint32) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids, [n, 2] character spans of each token in `text`), from one encoding of the whole text."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
        return np.asarray(encoding.ids, dtype=np.uint32), offsets

    def spec(self) -> dict:
        return {"kind": self.kind, "file": self.file, "eos_token": self.eos_token, "add_bos": self.add_bos}

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def train_bpe(texts: Iterable[str], vocab_size: int, out_file: Path) -> HFTokenizer:
    """A byte-level BPE tokenizer trained on `texts`, saved as `out_file` (tokenizer.json)."""
    if vocab_size < BYTES_VOCAB + 1:
        raise DatasetError(f"--vocab-size {vocab_size}: a byte-level BPE needs at least {BYTES_VOCAB + 1} "
                           "(256 bytes and the end-of-text token)")
    tk = _tokenizers()
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[TRAINED_EOS], show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tmp = out_file.with_name(f".{out_file.name}.tmp-{os.getpid()}")
    tok.save(str(tmp))
    os.replace(tmp, out_file)
    return HFTokenizer(out_file, kind="bpe", eos_token=TRAINED_EOS)


def from_spec(spec: dict):
    """Rebuild a tokenizer in a worker process (from what `spec()` returned)."""
    if spec["kind"] == "bytes":
        return ByteTokenizer()
    return HFTokenizer(spec["file"], kind=spec["kind"], eos_token=spec["eos_token"], add_bos=spec.get("add_bos"))


def token_string(tokenizer_file: str | Path, token_id: int) -> str | None:
    """The text of a special token of a tokenizer.json (for tokenizer_config.json), or None."""
    try:
        data = json.loads(Path(tokenizer_file).read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return next((t.get("content") for t in data.get("added_tokens", []) if t.get("id") == token_id), None)
