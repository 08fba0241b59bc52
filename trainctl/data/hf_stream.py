"""`data=hf`: a Hugging Face `datasets` split read as a stream of token windows, tokenized on the fly.

The split (a Hub name through the datasets cache, a `save_to_disk` folder, or data files; hf_source.load) is read
as an IterableDataset (`data.streaming=true`: never downloaded or converted whole, for corpora larger than the
disk), split across the data-parallel ranks by datasets' `split_dataset_by_node`, and each rank packs its own
documents (the tokenizer's prefix, the text's ids, the end-of-document id, as `data prepare` writes them) into
windows of `seq_len + 1` tokens that do not overlap.

The position is exact: `state_dict()` is the IterableDataset's own state (datasets resumes at the shard and the
row) plus the tokens pulled but not yet windowed, and the epoch; a stream restored from it yields the same windows
as one that never stopped. A split read to its end starts again (the next epoch) in the same order.

Chat and instruction rows (data.messages_field, or data.prompt_field with data.completion_field) become documents
through `data prepare --format chat|instruction`'s own code (data/chat.py: the tokenizer folder's chat template,
the assistant's spans, one encoding's offsets), so each carries the same ids and loss-mask flags as a prepared
dataset of the same records; the flags travel beside the tokens, in the windows and in the state.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from trainctl.data import hf_source
from trainctl.data.chat import RecordOptions, document_text, document_tokens
from trainctl.data.chat_template import load_template
from trainctl.data.format import DatasetError

DOCS_PER_PULL = 64  # documents tokenized in one batch (the tokenizer's encode_batch)


def record_fields(d) -> dict[str, str]:
    """{config key: dataset field} that data=hf reads (a DataConfig's): the chat, instruction or text field(s)."""
    if d.messages_field:
        return {"data.messages_field": d.messages_field}
    if d.prompt_field or d.completion_field:
        return {"data.prompt_field": d.prompt_field, "data.completion_field": d.completion_field}
    return {"data.text_field": d.text_field or "text"}


def record_options(d) -> RecordOptions | None:
    """data prepare's options for chat or instruction rows (the template from data.tokenizer's folder); None: text."""
    if d.messages_field:
        if d.tokenizer == "bytes":
            raise DatasetError(f"data.messages_field={d.messages_field}: data.tokenizer=bytes has no chat template; "
                               "use a tokenizer folder with one (data.tokenizer=DIR), or data.prompt_field and "
                               "data.completion_field")
        try:
            template = load_template(None, Path(d.tokenizer).parent)
        except DatasetError:
            raise DatasetError(f"data.messages_field={d.messages_field}: the tokenizer folder "
                               f"{Path(d.tokenizer).parent} has no chat template (chat_template.jinja, or "
                               "chat_template in tokenizer_config.json); use a tokenizer that has one, or "
                               "data.prompt_field and data.completion_field") from None
        return RecordOptions("chat", messages_field=d.messages_field, template=template)
    if d.prompt_field or d.completion_field:
        return RecordOptions("instruction", prompt_field=d.prompt_field, completion_field=d.completion_field)
    return None


def open_split(source: str, split: str, config: str, streaming: bool, fields: dict[str, str], rank: int,
               world: int, split_key: str = "data.split"):
    """This rank's share of the split's `fields` ({key: field}), as an IterableDataset; DatasetError otherwise."""
    import datasets
    from datasets.distributed import split_dataset_by_node

    try:
        dataset = hf_source.load(source, split, config or None, streaming=streaming)
    except DatasetError as exc:  # its words are data prepare's options: here they are config keys
        words = str(exc).replace("--split / --hf-config", f"{split_key} / data.hf_config")
        raise DatasetError(words.replace("--hf ", "data.source=").replace("--split ", f"{split_key}=")) from None
    names = list(dataset.column_names or [])
    for key, field in fields.items():
        if names and field not in names:
            raise DatasetError(f"{key}={field}: {source} split {split} has no such field (fields: "
                               f"{', '.join(names)}); name its {key.split('.')[1].replace('_field', '')} field")
    if isinstance(dataset, datasets.Dataset):  # a table on disk (or a save_to_disk folder, streamed or not)
        dataset = dataset.to_iterable_dataset(num_shards=max(1, min(world, dataset.num_rows)))
    return split_dataset_by_node(dataset.select_columns(list(fields.values())), rank=rank, world_size=world)


def open_tokenizer(spec: str):
    """data.tokenizer as resolved at compose time: `bytes`, or a tokenizer.json (its folder's eos and bos)."""
    from trainctl.data.tokenizer import ByteTokenizer, HFTokenizer

    if spec == "bytes":
        return ByteTokenizer()
    try:
        return HFTokenizer(spec)
    except DatasetError as exc:
        raise DatasetError(str(exc).replace("--tokenizer ", "data.tokenizer=").replace("--eos-token", "its "
                                            "tokenizer_config.json eos_token")) from None


class Documents:
    """Rows into (ids, flags) documents: text as `data prepare` packs it (flags None), chat and instruction rows
    through data/chat.py with their loss-mask flags."""

    def __init__(self, d, tokenizer, where: str):
        self.tokenizer, self.where = tokenizer, where
        self.fields, self.records = record_fields(d), record_options(d)
        self.masked = self.records is not None

    def __call__(self, rows: list[dict], first: int) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """The documents of `rows`, the first of which is this rank's document number `first`."""
        if self.records is None:
            return self._texts(rows)
        docs = []
        for n, row in enumerate(rows):
            try:
                text, spans = document_text(row, self.records)
                ids, flags = document_tokens(text, spans, self.tokenizer, self.records)
            except ValueError as exc:
                words = str(exc)
                for option, key in (("--messages-field", "data.messages_field"),
                                    ("--prompt-field", "data.prompt_field"),
                                    ("--completion-field", "data.completion_field")):
                    words = words.replace(option, key)
                raise DatasetError(f"{self.where}: document {first + n} of this rank's share: {words}") from None
            docs.append((ids.astype(np.int64), flags))
        return docs

    def _texts(self, rows: list[dict]) -> list[tuple[np.ndarray, None]]:
        (key, field), = self.fields.items()
        texts = [row[field] for row in rows]
        bad = next((t for t in texts if not isinstance(t, str)), None)
        if bad is not None:
            raise DatasetError(f"{self.where}: a row's {field} is {type(bad).__name__}, not text; name a text field "
                               f"with {key}")
        prefix = np.asarray(self.tokenizer.prefix, dtype=np.int64)
        eos = np.asarray([self.tokenizer.eos_id], dtype=np.int64)
        return [(np.concatenate([prefix, np.asarray(ids, dtype=np.int64), eos]), None)
                for ids in self.tokenizer.encode_batch(texts)]


def first_document(d, split: str) -> None:
    """The split's first row made a document (DatasetError in one line naming the key when the split, a field, the
    rows or the row itself lack)."""
    key = "data.split" if split == d.split else "data.val_split"
    rows = open_split(d.source, split, d.hf_config, d.streaming, record_fields(d), 0, 1, key)
    documents = Documents(d, open_tokenizer(d.tokenizer), f"data.source={d.source} ({split})")
    for row in rows:
        documents([row], 0)
        return
    raise DatasetError(f"{key}={split}: {d.source} has no rows in it; name a split with rows")


class PackedStream:
    """Windows of `width` tokens (and their flags, for masked documents) packed from the documents of one rank's
    IterableDataset, with an exact state."""

    def __init__(self, open_dataset: Callable, documents: Documents, width: int, where: str):
        self._open, self._documents, self.width, self.where = open_dataset, documents, width, where
        self.epoch, self.documents = 0, 0
        self._buffer = np.zeros(0, dtype=np.int64)
        self._flags = np.zeros(0, dtype=np.uint8) if documents.masked else None
        self._dataset = open_dataset()
        self._rows = None  # the live iterator, made at the first pull (after a load_state_dict)
        self._from_start = True  # the live pass began at the split's first row (not at a restored position)

    def state_dict(self) -> dict:
        state = {"epoch": self.epoch, "documents": self.documents, "dataset": self._dataset.state_dict(),
                 "buffer": self._buffer.tolist()}
        if self._flags is not None:  # only then: a text stream's state is as before
            state["flags"] = self._flags.tolist()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.documents = int(state["epoch"]), int(state["documents"])
        self._buffer = np.asarray(state["buffer"], dtype=np.int64)
        if self._flags is not None:
            if "flags" not in state:
                raise DatasetError(f"{self.where}: the checkpoint's stream position holds no loss masks (it was "
                                   "saved by a run on text); resume with the data keys it was saved with")
            self._flags = np.asarray(state["flags"], dtype=np.uint8)
        self._dataset = self._open()
        self._dataset.load_state_dict(state["dataset"])
        self._rows, self._from_start = None, False

    def windows(self, count: int) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """The next `count` windows of `width` tokens, each with its flags (None for text)."""
        while self._buffer.size < count * self.width:
            self._pull()
        w = self.width
        out = [(self._buffer[i * w:(i + 1) * w], None if self._flags is None else self._flags[i * w:(i + 1) * w])
               for i in range(count)]
        self._buffer = self._buffer[count * w:].copy()
        if self._flags is not None:
            self._flags = self._flags[count * w:].copy()
        return out

    def _pull(self) -> None:
        """Tokenize the next documents onto the buffer; at the split's end, start it again (the next epoch)."""
        if self._rows is None:
            self._rows = iter(self._dataset)
        rows = []
        for row in self._rows:
            rows.append(row)
            if len(rows) == DOCS_PER_PULL:
                break
        if not rows:
            if self._from_start:  # a whole pass from the first row gave nothing
                raise DatasetError(f"{self.where}: no rows for this data-parallel rank; use a dataset with at "
                                   "least as many rows as data-parallel ranks")
            self.epoch += 1
            self._dataset = self._open()
            self._rows, self._from_start = None, True
            return
        self._from_start = False
        docs = self._documents(rows, self.documents)
        self._buffer = np.concatenate([self._buffer, *(ids for ids, _ in docs)])
        if self._flags is not None:
            self._flags = np.concatenate([self._flags, *(flags for _, flags in docs)])
        self.documents += len(rows)
