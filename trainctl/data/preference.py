"""Preference pairs for `data prepare --format preference`: each record's chosen and rejected answers, side by side.

A record holds `chosen` and `rejected` answers and, usually, a `prompt` (--prompt-field), in the layouts TRL's
DPOTrainer reads:
  prompt text, answers text          {"prompt": "Q", "chosen": "good", "rejected": "bad"}
  prompt and answers as messages     {"prompt": [{role: user, ...}], "chosen": [{role: assistant, ...}], ...}
  conversations with the prompt in   {"chosen": [user, assistant], "rejected": [user, other assistant]}
A text prompt is one user message and a text answer one assistant message; the conversation is then rendered
by the chat template and masked exactly as an SFT chat record (data/chat.py: the answer's tokens count, the
prompt's do not). Without a prompt, the messages that both conversations share are the prompt.

On disk a pair is two documents in a row, the chosen one first; the rejected one's first token carries the
REJECTED flag beside DOC_START (data/format.py), so the worker reads pairs back whole (one micro-batch, one
rank) and can check that no pair was torn. Both documents go to the split the chosen one's text hashes to.

Refused, with the record's line: identical answers (no preference to learn) and an empty answer.
"""

from __future__ import annotations

import numpy as np

from trainctl.data.chat import (
    RecordOptions,
    _messages,
    _string_field,
    document_tokens,
    unit_records,
)
from trainctl.data.chat_template import TemplateRefusal, assistant_spans
from trainctl.data.format import REJECTED, DatasetError
from trainctl.data.inputs import Unit, json_kind
from trainctl.data.split import is_val

ANSWERS = ("chosen", "rejected")


def _conversation(record: dict, name: str) -> list[dict]:
    """A field as a list of messages: text is one message (user for the prompt, assistant for an answer)."""
    value = record.get(name)
    if isinstance(value, str):
        _string_field(record, name, "--prompt-field" if name not in ANSWERS else "its layout")
        return [{"role": "user" if name not in ANSWERS else "assistant", "content": value}]
    if isinstance(value, list):
        return _messages(record, name)
    if name not in record:
        raise ValueError(f"no field {name!r} (fields: {', '.join(map(str, record)) or 'none'}); a preference "
                         "record holds prompt, chosen and rejected")
    raise ValueError(f"field {name!r} is {json_kind(value)}, not text or a list of {{role, content}}")


def _empty(messages: list[dict]) -> bool:
    return not any(m["role"] == "assistant" and m["content"].strip() for m in messages)


def pair_conversations(record: object, options: RecordOptions) -> tuple[list[dict], list[dict], int]:
    """(chosen conversation, rejected conversation, how many leading messages are the prompt)."""
    if not isinstance(record, dict):
        raise ValueError(f"a {type(record).__name__}, not a JSON object")
    for name in ANSWERS:
        if isinstance(record.get(name), str | list) and not record[name]:
            raise ValueError(f"field {name!r} is empty: no answer to prefer; drop the record or fill it in")
    chosen, rejected = _conversation(record, "chosen"), _conversation(record, "rejected")
    if options.prompt_field in record:
        prompt = _conversation(record, options.prompt_field)
        chosen, rejected, shared = prompt + chosen, prompt + rejected, len(prompt)
    else:  # the prompt is in the conversations: what they share
        shared = next((i for i, (a, b) in enumerate(zip(chosen, rejected, strict=False)) if a != b),
                      min(len(chosen), len(rejected)))
    for name, conversation in zip(ANSWERS, (chosen, rejected), strict=True):
        if _empty(conversation[shared:]):
            raise ValueError(f"field {name!r} has no assistant text: no answer to prefer; drop the record or fill "
                             "it in")
    if chosen == rejected:
        raise ValueError("chosen and rejected are identical: no preference to learn; drop the record")
    return chosen, rejected, shared


def answer_document(messages: list[dict], shared: int, options: RecordOptions) -> tuple[str, list[tuple[int, int]]]:
    """(text, counted character spans) of one answer: the assistant spans after the shared prompt."""
    try:
        text, spans = assistant_spans(options.template, messages)
        prompt_end = len(assistant_spans(options.template, messages[:shared])[0]) if shared else 0
    except TemplateRefusal as exc:
        raise ValueError(f"the chat template ({options.template.source}) refuses it: {exc}") from None
    return text, [(max(first, prompt_end), end) for first, end in spans if end > prompt_end]


def pair_tokens(record: object, options: RecordOptions, tokenizer) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """[(text, ids, flags) of the chosen document, the same of the rejected one (REJECTED on its first token)]."""
    chosen, rejected, shared = pair_conversations(record, options)
    out = []
    for messages in (chosen, rejected):
        text, spans = answer_document(messages, shared, options)
        out.append((text, *document_tokens(text, spans, tokenizer, options)))
    if np.array_equal(out[0][1], out[1][1]):
        raise ValueError("chosen and rejected tokenize alike: no preference to learn; drop the record")
    out[1][2][0] |= REJECTED
    return out


def _where(unit: Unit, where: str) -> str:
    """A .jsonl record's line number (counted only for a refusal: records are read by byte offset)."""
    if not where.startswith("byte "):
        return where
    offset = int(where.split()[1])
    with unit.path.open("rb") as f:
        lines = f.read(offset).count(b"\n")
    return f"line {lines + 1}"


def tokenize_pairs(unit: Unit, options: RecordOptions, seed: int, val_fraction: float, tokenizer,
                   last_to: str | None = None) -> dict:
    """data/chat.py's tokenize_records for preference pairs: each pair's two documents kept together."""
    parts: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {"train": [], "val": []}
    records = list(unit_records(unit))
    for n, (where, record) in enumerate(records):
        try:
            pair = pair_tokens(record, options, tokenizer)
        except ValueError as exc:
            raise DatasetError(f"{unit.path}: {_where(unit, where)}: {exc}") from None
        split = "val" if is_val(seed, pair[0][0], val_fraction) else "train"
        if last_to and n == len(records) - 1:
            split = last_to
        parts[split] += [(ids, flags) for _, ids, flags in pair]
    result: dict = {"pieces": sum(len(docs) for docs in parts.values()) // 2}
    for split, docs in parts.items():
        result[split] = np.concatenate([d[0] for d in docs]) if docs else np.zeros(0, np.uint32)
        result[f"{split}_mask"] = np.concatenate([d[1] for d in docs]) if docs else np.zeros(0, np.uint8)
        result[f"{split}_docs"] = len(docs)
    return result
