"""`data=hf`: a Hugging Face `datasets` split read as a stream of token windows, tokenized on the fly.

The split (a Hub name through the datasets cache, a `save_to_disk` folder, or data files; hf_source.load) is read
as an IterableDataset (`data.streaming=true`: never downloaded or converted whole, for corpora larger than the
disk), split across the data-parallel ranks by datasets' `split_dataset_by_node`, and each rank packs its own
documents (the tokenizer's prefix, the text's ids, the end-of-document id, as `data prepare` writes them) into
windows of `seq_len + 1` tokens that do not overlap.

The position is exact: `state_dict()` is the IterableDataset's own state (datasets resumes at the shard and the
row) plus the tokens pulled but not yet windowed, and the epoch; a stream restored from it yields the same windows
as one that never stopped. A split read to its end starts again (the next epoch) in the same order.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from trainctl.data import hf_source
from trainctl.data.format import DatasetError

DOCS_PER_PULL = 64  # documents tokenized in one batch (the tokenizer's encode_batch)


def open_split(source: str, split: str, config: str, streaming: bool, text_field: str, rank: int, world: int,
               split_key: str = "data.split"):
    """This rank's share of the split's `text_field`, as an IterableDataset; DatasetError in one line otherwise."""
    import datasets
    from datasets.distributed import split_dataset_by_node

    try:
        dataset = hf_source.load(source, split, config or None, streaming=streaming)
    except DatasetError as exc:  # its words are data prepare's options: here they are config keys
        words = str(exc).replace("--split / --hf-config", f"{split_key} / data.hf_config")
        raise DatasetError(words.replace("--hf ", "data.source=").replace("--split ", f"{split_key}=")) from None
    names = list(dataset.column_names or [])
    if names and text_field not in names:
        raise DatasetError(f"data.text_field={text_field}: {source} split {split} has no such field (fields: "
                           f"{', '.join(names)}); name its text field")
    if isinstance(dataset, datasets.Dataset):  # a table on disk (or a save_to_disk folder, streamed or not)
        dataset = dataset.to_iterable_dataset(num_shards=max(1, min(world, dataset.num_rows)))
    return split_dataset_by_node(dataset.select_columns([text_field]), rank=rank, world_size=world)


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


def first_text(d, split: str) -> str:
    """The split's first document (DatasetError in one line naming the key when the split, field or rows lack)."""
    key = "data.split" if split == d.split else "data.val_split"
    rows = open_split(d.source, split, d.hf_config, d.streaming, d.text_field, 0, 1, key)
    for row in rows:
        text = row[d.text_field]
        if not isinstance(text, str):
            raise DatasetError(f"data.text_field={d.text_field}: {d.source} holds {type(text).__name__} there, not "
                               "text; name a text field")
        return text
    raise DatasetError(f"{key}={split}: {d.source} has no rows in it; name a split with rows")


class PackedStream:
    """Windows of `width` tokens packed from the documents of one rank's IterableDataset, with an exact state."""

    def __init__(self, open_dataset: Callable, encode: Callable, prefix: np.ndarray, eos_id: int, width: int,
                 text_field: str, where: str):
        self._open, self._encode, self.width = open_dataset, encode, width
        self.text_field, self.where = text_field, where
        self._wrap = (np.asarray(prefix, dtype=np.int64), np.asarray([eos_id], dtype=np.int64))
        self.epoch, self.documents = 0, 0
        self._buffer = np.zeros(0, dtype=np.int64)
        self._dataset = open_dataset()
        self._rows = None  # the live iterator, made at the first pull (after a load_state_dict)
        self._from_start = True  # the live pass began at the split's first row (not at a restored position)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "documents": self.documents, "dataset": self._dataset.state_dict(),
                "buffer": self._buffer.tolist()}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.documents = int(state["epoch"]), int(state["documents"])
        self._buffer = np.asarray(state["buffer"], dtype=np.int64)
        self._dataset = self._open()
        self._dataset.load_state_dict(state["dataset"])
        self._rows, self._from_start = None, False

    def windows(self, count: int) -> list[np.ndarray]:
        """The next `count` windows of `width` tokens."""
        while self._buffer.size < count * self.width:
            self._pull()
        out = [self._buffer[i * self.width:(i + 1) * self.width] for i in range(count)]
        self._buffer = self._buffer[count * self.width:].copy()
        return out

    def _pull(self) -> None:
        """Tokenize the next documents onto the buffer; at the split's end, start it again (the next epoch)."""
        if self._rows is None:
            self._rows = iter(self._dataset)
        texts = []
        for row in self._rows:
            texts.append(row[self.text_field])
            if len(texts) == DOCS_PER_PULL:
                break
        if not texts:
            if self._from_start:  # a whole pass from the first row gave nothing
                raise DatasetError(f"{self.where}: no rows for this data-parallel rank; use a dataset with at "
                                   "least as many rows as data-parallel ranks")
            self.epoch += 1
            self._dataset = self._open()
            self._rows, self._from_start = None, True
            return
        self._from_start = False
        bad = next((t for t in texts if not isinstance(t, str)), None)
        if bad is not None:
            raise DatasetError(f"{self.where}: a row's {self.text_field} is {type(bad).__name__}, not text; name "
                               "a text field with data.text_field")
        prefix, eos = self._wrap
        parts = [self._buffer]
        for ids in self._encode(texts):
            parts += [prefix, np.asarray(ids, dtype=np.int64), eos]
        self._buffer = np.concatenate(parts)
        self.documents += len(texts)
