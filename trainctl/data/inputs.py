"""The user's text for `data prepare`: which files, and their documents in pieces that workers share.

A large .jsonl file is cut into pieces of about `UNIT_BYTES` at line ends and a .parquet file into its
row groups, so one big file keeps every core busy and no worker holds more than a piece in memory; a
text file is one document, so it is one piece. Pieces are numbered in input order, and the output is
written in that order whatever the number of workers.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from trainctl.data.format import DatasetError

SUFFIXES = (".txt", ".md", ".jsonl", ".parquet")  # what a folder is searched for (a named file may be any)
JSON_LINES = (".jsonl", ".json")
UNIT_BYTES = 32 << 20


@dataclass(frozen=True)
class Unit:
    """A piece of one input file: bytes [start, end) of a .jsonl, a .parquet row group, or a whole text file."""

    path: Path
    start: int
    end: int
    row_group: int | None = None

    @property
    def size(self) -> int:
        return self.end - self.start


def expand_inputs(inputs: list[str], out: Path | None = None) -> list[Path]:
    """Files named, found in folders, or matched by globs: sorted, each once; a pattern matching nothing fails.

    Nothing inside `out` (the dataset being written) is an input.
    """
    found: set[Path] = set()
    for item in inputs:
        path = Path(item).expanduser()
        if path.is_file():
            found.add(path.resolve())
        elif path.is_dir():
            found |= {p.resolve() for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES}
        elif glob.has_magic(item):
            found |= {Path(p).resolve() for p in glob.glob(os.path.expanduser(item), recursive=True)
                      if Path(p).is_file()}
        else:
            raise DatasetError(f"{item}: no such file or folder; pass text files, folders or glob patterns")
        if out is not None:
            found = {p for p in found if not p.is_relative_to(out)}
        if not found:
            raise DatasetError(f"{item}: matches no input file ({', '.join(SUFFIXES)})")
    return sorted(found)


def plan_units(files: list[Path], unit_bytes: int = UNIT_BYTES) -> list[Unit]:
    """Every file's pieces, in input order."""
    units: list[Unit] = []
    for path in files:
        size = path.stat().st_size
        if path.suffix == ".parquet":
            groups = _parquet(path).metadata.num_row_groups
            edges = [size * g // max(groups, 1) for g in range(groups + 1)]  # for progress only
            units += [Unit(path, edges[g], edges[g + 1], row_group=g) for g in range(groups)]
        elif path.suffix in JSON_LINES:
            units += _line_pieces(path, size, unit_bytes)
        else:
            units.append(Unit(path, 0, size))
    return units


def _line_pieces(path: Path, size: int, unit_bytes: int) -> list[Unit]:
    pieces, start = [], 0
    with path.open("rb") as f:
        while start < size:
            end = min(start + unit_bytes, size)
            if end < size:
                f.seek(end)
                f.readline()  # to the end of the line that straddles the cut
                end = f.tell()
            pieces.append(Unit(path, start, end))
            start = end
    return pieces


def unit_documents(unit: Unit, text_field: str) -> Iterator[str]:
    """The documents of one piece."""
    if unit.row_group is not None:
        table = _parquet(unit.path).read_row_group(unit.row_group, columns=[_column(unit.path, text_field)])
        yield from (text for text in table.column(0).to_pylist() if text)
    elif unit.path.suffix in JSON_LINES:
        with unit.path.open("rb") as f:
            f.seek(unit.start)
            data = f.read(unit.size)
        offset = unit.start
        for line in data.split(b"\n"):
            if line.strip():
                yield _json_text(line, text_field, unit.path, offset)
            offset += len(line) + 1
    else:
        yield unit.path.read_text(encoding="utf-8", errors="replace")


def documents(path: Path, text_field: str) -> Iterator[str]:
    """Every document of one input file."""
    for unit in plan_units([path]):
        yield from unit_documents(unit, text_field)


def _json_text(line: bytes, field: str, path: Path, offset: int) -> str:
    try:
        record = json.loads(line)
    except ValueError:
        raise DatasetError(f"{path}: byte {offset}: not a JSON object per line (.jsonl)") from None
    if not isinstance(record, dict) or not isinstance(record.get(field), str):
        raise DatasetError(f"{path}: byte {offset}: no text field {field!r}; name the field with --text-field")
    return record[field]


def _parquet(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"{path}: reading .parquet needs pyarrow: pip install pyarrow") from None
    try:
        return pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises its own ArrowInvalid (a ValueError) and OSErrors
        raise DatasetError(f"{path}: not a readable parquet file ({exc})") from None


def _column(path: Path, field: str) -> str:
    names = _parquet(path).schema_arrow.names
    if field not in names:
        raise DatasetError(f"{path}: no column {field!r} (columns: {', '.join(names)}); name it with --text-field")
    return field


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
