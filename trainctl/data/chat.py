"""Chat and instruction records for `data prepare --format chat|instruction`: tokens with loss masks.

One record is one document, never cut into pieces: a chat record's `messages` list of {role, content}
rendered by the chat template (data/chat_template.py), or an instruction record's prompt and completion
concatenated. The loss counts the assistant's (completion's) tokens only: the characters each assistant turn
adds to the rendering (its end-of-turn token included), mapped to tokens with the offsets of ONE encoding of
the whole text (tokens that overlap a span count), never by encoding pieces apart (which tokenizes the seams
differently). Each document is followed by EOS, unless its rendering already ends with it; that EOS counts
for an instruction record (the model learns to stop) and not for a chat one (the template's own end-of-turn
token is the stop it learns).

A record goes to train or val by a hash of its text (data/split.py), as a text document does.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainctl.data.chat_template import ChatTemplate, TemplateRefusal, assistant_spans, load_template
from trainctl.data.format import CONTENTS, DOC_START, LOSS, DatasetError
from trainctl.data.inputs import (
    JSON_LINES,
    Unit,
    _decoded,
    _parquet,
    json_kind,
    json_lines,
    not_text,
    too_deep,
    unit_bytes,
)
from trainctl.data.split import is_val

OVERLONG = ("refuse", "truncate")


@dataclass(frozen=True)
class RecordOptions:
    """How records become documents (everything here is part of prepare's resume fingerprint)."""

    format: str  # chat | instruction
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    template: ChatTemplate | None = None  # chat only
    max_doc_tokens: int | None = None
    overlong: str = "refuse"


def check_options(options: RecordOptions, input_suffixes: set[str]) -> None:
    if options.max_doc_tokens is not None and options.max_doc_tokens < 2:
        raise DatasetError(f"--max-doc-tokens {options.max_doc_tokens}: use at least 2 (a document and its EOS); "
                           "e.g. train.seq_len + 1")
    if options.overlong not in OVERLONG:
        raise DatasetError(f"--overlong {options.overlong}: use one of {', '.join(OVERLONG)}")
    other = sorted(input_suffixes - {*JSON_LINES, ".parquet"})
    if other:
        raise DatasetError(f"--format {options.format}: reads .jsonl and .parquet records, not {', '.join(other)} "
                           "files; pass the records' files only")


def resolve_options(records: RecordOptions | None, chat_template: str | None, given: Path | None,
                    train_tokenizer: bool, files: list[Path]) -> RecordOptions | None:
    """The record options checked, with the chat template loaded (before anything is written)."""
    if records is None or records.format == "text":
        if chat_template:
            raise DatasetError(f"--chat-template {chat_template}: only with --format chat")
        if records is not None and records.max_doc_tokens is not None:
            raise DatasetError(f"--max-doc-tokens {records.max_doc_tokens}: only with --format chat or instruction "
                               "(text documents are cut into pieces as they are)")
        return None
    if records.format not in CONTENTS:
        raise DatasetError(f"--format {records.format}: use one of {', '.join(CONTENTS)}")
    if train_tokenizer:
        raise DatasetError(f"--format {records.format} and --train-tokenizer: train a tokenizer on the text first, "
                           "or pass --tokenizer (a Hugging Face tokenizer.json or its folder) or bytes")
    check_options(records, {p.suffix for p in files})
    if records.format in ("chat", "preference"):  # preference pairs are chat records twice (data/preference.py)
        records = dataclasses.replace(records, template=load_template(chat_template, given and given.parent))
    elif chat_template:
        raise DatasetError(f"--chat-template {chat_template}: only with --format chat (instruction records are "
                           "prompt + completion as written)")
    return records


# ---------------------------------------------------------------- records


def unit_records(unit: Unit) -> Iterator[tuple[str, object]]:
    """(where, record) of each record of one piece: "byte N" of a .jsonl line, "row N" of a .parquet row."""
    if unit.row_group is not None:
        with _parquet(unit.path) as pf:
            rows = pf.read_row_group(unit.row_group).to_pylist()
            first = sum(pf.metadata.row_group(g).num_rows for g in range(unit.row_group))
        for n, row in enumerate(rows):
            yield f"row {first + n}", row
        return
    for offset, line in json_lines(*unit_bytes(unit)):
        try:
            record = json.loads(_decoded(line, unit.path, offset))
        except ValueError:
            raise DatasetError(f"{unit.path}: byte {offset}: not a JSON object per line (.jsonl)") from None
        except RecursionError:
            raise DatasetError(too_deep(unit.path, offset)) from None
        yield f"byte {offset}", record


def document_text(record: object, options: RecordOptions) -> tuple[str, list[tuple[int, int]]]:
    """(text, the character spans that count in the loss); ValueError says what is wrong with the record."""
    if not isinstance(record, dict):
        raise ValueError(f"a {type(record).__name__}, not a JSON object")
    if options.format == "instruction":
        prompt = _string_field(record, options.prompt_field, "--prompt-field")
        completion = _string_field(record, options.completion_field, "--completion-field")
        if not completion:
            raise ValueError(f"field {options.completion_field!r} is empty: nothing would count in the loss; "
                             "drop the record or fill in the completion")
        return prompt + completion, [(len(prompt), len(prompt) + len(completion))]
    messages = _messages(record, options.messages_field)
    try:
        text, spans = assistant_spans(options.template, messages)
    except TemplateRefusal as exc:
        raise ValueError(f"the chat template ({options.template.source}) refuses it: {exc}") from None
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("no assistant message: nothing in it would count in the loss; drop the record or add "
                         "the answer")
    return text, spans


def _string_field(record: dict, name: str, option: str) -> str:
    if name not in record:
        raise ValueError(f"no field {name!r} (fields: {', '.join(map(str, record)) or 'none'}); name it with "
                         f"{option}")
    if not isinstance(record[name], str):
        raise ValueError(f"field {name!r} is {json_kind(record[name])}, not a string")
    _text(record[name], f"field {name!r}")
    return record[name]


def _text(value: str, what: str) -> None:
    """Text input's refusal (inputs.not_text): a '?' in place of a lone surrogate or a vanished NUL is other text."""
    problem = not_text(value)
    if problem:
        raise ValueError(f"{what} holds {problem}, not text; fix the record")


def _messages(record: dict, name: str) -> list[dict]:
    if name not in record:
        raise ValueError(f"no field {name!r} (fields: {', '.join(map(str, record)) or 'none'}); name the "
                         "conversation's field with --messages-field")
    messages = record[name]
    if not isinstance(messages, list):
        raise ValueError(f"field {name!r} is {json_kind(messages)}, not a list of {{role, content}}")
    if not messages:
        raise ValueError(f"field {name!r} is an empty list: no conversation; drop the record")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"message {i} is {json_kind(message)}, not an object with role and content")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                what = "missing" if message.get(key) is None else json_kind(message[key])
                raise ValueError(f"message {i}: {key} is {what}, not a string")
            _text(message[key], f"message {i}: {key}")
    return messages


# ---------------------------------------------------------------- tokens


def token_flags(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """LOSS on each token whose character span overlaps a counted span (an empty span is its start char)."""
    starts = offsets[:, 0]
    ends = np.maximum(offsets[:, 1], starts + 1)
    counted = np.zeros(len(offsets), dtype=bool)
    for first, end in spans:
        counted |= (starts < end) & (ends > first)
    return np.where(counted, LOSS, 0).astype(np.uint8)


def document_tokens(text: str, spans: list[tuple[int, int]], tokenizer, options: RecordOptions
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(ids, flags) of one document with its EOS; ValueError for one too long or left without a counted token."""
    ids, offsets = tokenizer.encode_offsets(text)
    flags = token_flags(offsets, spans)
    if not ids.size or ids[-1] != tokenizer.eos_id:
        eos_flag = LOSS if options.format == "instruction" else 0
        ids = np.append(ids, np.uint32(tokenizer.eos_id))
        flags = np.append(flags, np.uint8(eos_flag))
    limit = options.max_doc_tokens
    if limit is not None and ids.size > limit:
        if options.overlong == "refuse":
            raise ValueError(f"{ids.size} tokens, more than --max-doc-tokens {limit}; raise it, or pass "
                             "--overlong truncate to keep its first tokens")
        ids, flags = ids[:limit], flags[:limit]
    if not (flags & LOSS).any():
        cut = " within --max-doc-tokens" if limit is not None and ids.size == limit else ""
        raise ValueError(f"no token of the answer{cut} counts in the loss; drop the record"
                         + (" or raise --max-doc-tokens" if cut else ""))
    flags[0] |= DOC_START
    return ids, flags


def count_loss_tokens(mask_file: Path) -> int:
    """Tokens of a mask file that count in the loss (read in blocks: a shard's masks may be large)."""
    total = 0
    with mask_file.open("rb") as f:
        while block := f.read(1 << 24):
            total += int(np.count_nonzero(np.frombuffer(block, np.uint8) & LOSS))
    return total


def tokenize_records(unit: Unit, options: RecordOptions, seed: int, val_fraction: float, tokenizer,
                     last_to: str | None = None) -> dict:
    """One unit's train and val tokens and mask flags (prepare_job.tokenize_unit's result, with masks)."""
    parts: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {"train": [], "val": []}
    records = unit_records(unit)
    current = next(records, None)
    while current is not None:
        following = next(records, None)
        where, record = current
        try:
            text, spans = document_text(record, options)
            ids, flags = document_tokens(text, spans, tokenizer, options)
        except ValueError as exc:
            raise DatasetError(f"{unit.path}: {where}: {exc}") from None
        split = "val" if is_val(seed, text, val_fraction) else "train"
        if last_to and following is None:
            split = last_to
        parts[split].append((ids, flags))
        current = following
    result: dict = {"pieces": len(parts["train"]) + len(parts["val"])}
    for split, docs in parts.items():
        result[split] = np.concatenate([d[0] for d in docs]) if docs else np.zeros(0, np.uint32)
        result[f"{split}_mask"] = np.concatenate([d[1] for d in docs]) if docs else np.zeros(0, np.uint8)
        result[f"{split}_docs"] = len(docs)
    return result
