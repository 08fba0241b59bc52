"""`data=hf` checks: the keys at compose time (no dataset opened), the dataset itself before launch.

Compose time (`config`, `plan`, `launch`): data.source given, a held-out split named when evaluation is on, and a
tokenizer found (data.tokenizer, else the model's Hugging Face folder), resolved into data.tokenizer so the workers
read the same file; one kind of row named (text, chat or instruction fields), and a chat template in the tokenizer's
folder for chat rows. Before launch (`hf_dataset_problems`): the dataset opens (offline mode honoured), has the
split and the named fields, its first row becomes a document, and the tokenizer's ids fit the vocabulary.
`datasets` is imported then only.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from trainctl.config.schema import CheckpointConfig, DataConfig, ModelConfig, TrainConfig
from trainctl.core import hub

BYTES = "bytes"  # data.tokenizer=bytes: UTF-8 bytes as ids 0..255 (no tokenizer file)


def tokenizer_file(d: DataConfig, m: ModelConfig, c: CheckpointConfig) -> tuple[str, str | None]:
    """(data.tokenizer resolved: a tokenizer.json path or `bytes`, the problem or None)."""
    given = d.tokenizer.strip()
    if given == BYTES:
        return BYTES, None
    folder = given or c.init_from or m.path
    if not folder:
        return "", ("data.tokenizer: data=hf tokenizes on the fly and the model names no tokenizer; set "
                    "data.tokenizer=/path/to/tokenizer.json (or its folder, or bytes), or model=hf model.path=DIR")
    try:
        folder = hub.resolve(folder) if given else folder
    except hub.HubError as exc:
        return "", f"data.tokenizer={exc}"
    path = Path(folder).expanduser()
    path = path / "tokenizer.json" if path.is_dir() else path
    if not path.is_file():
        key = "data.tokenizer" if given else "model.path" if folder == m.path else "checkpoint.init_from"
        return "", (f"{key}={folder}: no tokenizer.json there for data=hf; set data.tokenizer=/path/to/"
                    "tokenizer.json (or bytes)")
    return str(path.resolve()), None


def hf_data_problems(d: DataConfig, m: ModelConfig, c: CheckpointConfig, t: TrainConfig) -> list[str]:
    """The data=hf keys, one line each (nothing opened but the tokenizer's path)."""
    if d.kind != "hf":
        return [f"data.{key}: read by data=hf only (data.kind={d.kind}); add data=hf"
                for key in ("source", "messages_field", "prompt_field", "completion_field") if getattr(d, key)]
    problems = []
    if not d.source.strip():
        problems.append("data.source: required for data=hf; pass a Hub dataset name (org/name), a save_to_disk "
                        "folder, or .parquet/.jsonl files: data.source=...")
    if not d.split.strip():
        problems.append("data.split: empty; name the dataset's split (e.g. train)")
    problems += record_field_problems(d)
    if not d.val_split and t.eval_every > 0:
        problems.append(f"data.val_split: train.eval_every={t.eval_every} evaluates on a held-out split; name one "
                        "(data.val_split=validation) or set train.eval_every=0")
    tokenizer, problem = tokenizer_file(d, m, c)
    if problem:
        problems.append(problem)
    elif d.messages_field and not problems:
        problems += chat_template_problems(dataclasses.replace(d, tokenizer=tokenizer))
    return problems


def record_field_problems(d: DataConfig) -> list[str]:
    """One kind of row: text, chat (messages_field) or instruction (prompt_field and completion_field)."""
    instruction = [f"data.{k}={getattr(d, k)}" for k in ("prompt_field", "completion_field") if getattr(d, k)]
    named = ([f"data.text_field={d.text_field}"] if d.text_field else []) + (
        [f"data.messages_field={d.messages_field}"] if d.messages_field else []) + instruction
    if len(named) > len(instruction) > 0 or (d.text_field and d.messages_field):
        return [f"{' and '.join(named)}: name one kind of row: data.text_field (all of it counts in the loss), "
                "data.messages_field (chat), or data.prompt_field with data.completion_field (instruction)"]
    if len(instruction) == 1:
        missing = "completion_field" if d.prompt_field else "prompt_field"
        return [f"{instruction[0]}: instruction rows need data.{missing} too (the completion is what counts in the "
                "loss); name both, or use data.text_field or data.messages_field"]
    return []


def chat_template_problems(d: DataConfig) -> list[str]:
    """data.messages_field renders with the tokenizer folder's own chat template: one must be there."""
    from trainctl.data import hf_stream
    from trainctl.data.format import DatasetError

    try:
        hf_stream.record_options(d)
    except DatasetError as exc:
        return [str(exc)]
    return []


def resolve_hf_data(d: DataConfig, m: ModelConfig, c: CheckpointConfig) -> DataConfig:
    """data.tokenizer as the workers read it: the tokenizer.json's absolute path, or bytes."""
    if d.kind != "hf":
        return d
    return dataclasses.replace(d, tokenizer=tokenizer_file(d, m, c)[0])


def hf_dataset_problems(d: DataConfig, vocab_size: int) -> list[str]:
    """Before launch: the dataset, its splits and text field, and the tokenizer's ids against the vocabulary."""
    if d.kind != "hf" or not d.source:
        return []
    from trainctl.data import hf_stream
    from trainctl.data.format import DatasetError

    try:
        tokenizer = hf_stream.open_tokenizer(d.tokenizer)
        if tokenizer.vocab_size > vocab_size:
            return [f"data.tokenizer={d.tokenizer}: {tokenizer.vocab_size} token ids, more than the vocabulary "
                    f"{vocab_size} (data.vocab_size, else model.vocab_size); use the model's tokenizer"]
        for split in [d.split] + ([d.val_split] if d.val_split else []):
            hf_stream.first_document(d, split)
    except DatasetError as exc:
        return [str(exc)]
    return []
