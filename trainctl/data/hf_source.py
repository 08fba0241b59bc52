"""`data prepare --hf NAME_OR_PATH`: the rows of a Hugging Face `datasets` dataset as prepare's records.

What is read: a folder written by `Dataset.save_to_disk` (or a DatasetDict's, one split of it), a local
.parquet / .arrow / .json / .jsonl / .csv file or a folder of them (`load_dataset(format, data_files=...)`), or a
Hub dataset name through the datasets cache (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE honoured).

The named fields of every row are written, in the dataset's row order, as one JSON object per line to a
temporary .jsonl file, and that file is prepared exactly as a .jsonl the user gave: the same record readers,
chat templating, loss masks, refusals and train/val split (data/prepare.py), so the token files are
byte-identical to a jsonl export of the same rows. The file lies in a folder of this process's own (two
prepares of the same dataset at once never share it, nor remove it under each other); its name is its
content's sha256 and its mtime is fixed, so the same dataset prepared again (a resume after Ctrl-C) lists the
same input under that name (prepare's `input_names`).

`datasets` is imported here only, when --hf is given: the launcher never imports it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from trainctl.data.format import DatasetError

FILE_FORMATS = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".jsonl": "json", ".csv": "csv"}
SAVED_MARKERS = ("dataset_dict.json", "state.json")  # what save_to_disk writes (a DatasetDict, a Dataset)
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def fields_of(data_format: str, text_field: str, messages_field: str, prompt_field: str,
              completion_field: str) -> list[str]:
    """The fields a record of this format is read from (data/chat.py and data/inputs.py read the same)."""
    return {"text": [text_field], "chat": [messages_field],
            "instruction": [prompt_field, completion_field],
            "preference": [prompt_field, "chosen", "rejected"]}.get(data_format, [text_field])


def _offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on") for v in OFFLINE_VARIABLES)


def _datasets():
    try:
        import datasets
    except ImportError:
        raise DatasetError("--hf: reading Hugging Face datasets needs the datasets package: "
                           "pip install 'trainctl[hf]' (or pip install datasets)") from None
    datasets.disable_progress_bars()  # prepare's own progress bar is the one the user watches
    datasets.logging.set_verbosity_error()  # its notes ("Using the latest cached version") on every rank's log
    return datasets


def load(name: str, split: str, config: str | None, streaming: bool = False):
    """The `split` of the dataset `name` (a save_to_disk folder, a data file or folder, a Hub name); `streaming`:
    an IterableDataset that reads rows as they are asked for (a save_to_disk folder is a Dataset either way)."""
    datasets = _datasets()
    path = Path(name).expanduser()
    try:
        if path.is_dir() and any((path / m).is_file() for m in SAVED_MARKERS):
            return _load_saved(datasets, path, name, split)
        if path.is_file():
            kind = FILE_FORMATS.get(path.suffix.lower())
            if kind is None:
                raise DatasetError(f"--hf {name}: a {path.suffix or 'suffix-less'} file; pass a "
                                   f"{', '.join(FILE_FORMATS)} file, a save_to_disk folder or a Hub dataset name")
            return _load_file(datasets, kind, path, name, split, streaming)
        return datasets.load_dataset(str(path) if path.is_dir() else name, config, split=split, streaming=streaming)
    except DatasetError:
        raise
    except ValueError as exc:  # an unknown split or configuration: datasets names the ones there are
        raise DatasetError(f"--hf {name}: {_first_line(exc)}; choose with --split / --hf-config") from None
    except Exception as exc:  # datasets raises FileNotFoundError, ConnectionError, its own DatasetNotFoundError
        if _offline() and not path.exists():
            raise DatasetError(f"--hf {name}: not in the Hugging Face datasets cache and offline "
                               f"({'/'.join(OFFLINE_VARIABLES)} set); fetch it once online: python -c \"import "
                               f"datasets; datasets.load_dataset('{name}'{_config_arg(config)})\"") from None
        raise DatasetError(f"--hf {name}: cannot load it ({type(exc).__name__}: {_first_line(exc)}); pass a "
                           "save_to_disk folder, a data file, or a Hub dataset name") from None


def _load_file(datasets, kind: str, path: Path, name: str, split: str, streaming: bool = False):
    """One data file as the split; a file without rows says so (datasets says StopIteration, or "no data")."""
    if path.stat().st_size == 0:
        raise _no_rows(name, f"the file {path.resolve()}")
    try:
        return datasets.load_dataset(kind, data_files={split: str(path)}, split=split, streaming=streaming)
    except ValueError as exc:  # the split is ours here: its "corresponds to no data" means the file has no rows
        if "no data" in str(exc):
            raise _no_rows(name, f"the file {path.resolve()}") from None
        raise


def _config_arg(config: str | None) -> str:
    return f", '{config}'" if config else ""


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0]


def _load_saved(datasets, path: Path, name: str, split: str):
    """A saved Dataset is the split itself; a saved DatasetDict gives `split` (read alone), or names the ones it has.

    A split saved with no rows has no data file, and datasets' loader fails on it with a bare IndexError: it is
    found first, from the split's state.json.
    """
    if (path / SAVED_MARKERS[0]).is_file():
        splits = json.loads((path / SAVED_MARKERS[0]).read_text(encoding="utf-8")).get("splits", [])
        if split not in splits:
            raise DatasetError(f"--split {split}: {name} has the splits {', '.join(splits)}; choose one")
        path = path / split
    state = json.loads((path / SAVED_MARKERS[1]).read_text(encoding="utf-8"))
    if isinstance(state, dict) and state.get("_data_files") == []:
        raise _no_rows(name, f"the dataset at {path.resolve()}")
    return datasets.load_from_disk(str(path))


def _no_rows(name: str, what: str) -> DatasetError:
    return DatasetError(f"--hf {name}: {what} has no rows; pass a dataset with at least one row")


def _check_fields(dataset, name: str, fields: list[str]) -> None:
    have = list(dataset.column_names)
    missing = [f for f in fields if f not in have]
    if missing:
        raise DatasetError(f"--hf {name}: no field {missing[0]!r} (fields: {', '.join(have) or 'none'}); name it "
                           "with --text-field, --messages-field or --prompt-field / --completion-field")


@contextlib.contextmanager
def exported(name: str, split: str, config: str | None, fields: list[str], optional: tuple[str, ...] = ()
             ) -> Iterator[Path]:
    """The named fields of the dataset's rows as a .jsonl file in a folder of its own (both removed afterwards,
    whatever happens), in row order. The file's name depends on the rows only: prepare lists the input by it. A
    field in `optional` is left out where the dataset lacks it (a preference set's prompt may be inside its
    conversations)."""
    dataset = load(name, split, config)
    if dataset.num_rows == 0:
        raise _no_rows(name, f"its split {split}")
    fields = [f for f in fields if f not in optional or f in dataset.column_names]
    _check_fields(dataset, name, fields)
    folder = Path(tempfile.mkdtemp(prefix="trainctl-hf-"))
    try:
        yield _write_rows(dataset, fields, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _write_rows(dataset, fields: list[str], folder: Path) -> Path:
    """The rows as jsonl in `folder`, named by their sha256, with a fixed mtime (prepare's resume compares it)."""
    digest, tmp = hashlib.sha256(), folder / "rows.jsonl.tmp"
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for row in _rows(dataset, fields):
            line = json.dumps(row, ensure_ascii=False) + "\n"
            digest.update(line.encode("utf-8"))
            f.write(line)
    path = folder / f"trainctl-hf-{digest.hexdigest()[:32]}.jsonl"
    os.replace(tmp, path)
    os.utime(path, ns=(0, 0))
    return path


def _rows(dataset, fields: list[str]) -> Iterator[dict]:
    """Each row's named fields, in order, read a batch of rows at a time (never the whole table in memory)."""
    for batch in dataset.select_columns(fields).iter(batch_size=1024):
        for i in range(len(batch[fields[0]])):
            yield {f: batch[f][i] for f in fields}
