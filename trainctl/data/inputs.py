"""The user's text for `data prepare`: which files, and their documents in pieces that workers share.

A large .jsonl file is cut into pieces of about `UNIT_BYTES` at line ends and a .parquet file into its
row groups, so one big file keeps every core busy and no worker holds more than a piece in memory; a
text file is one document, so it is one piece. Pieces are numbered in input order, and the output is
written in that order whatever the number of workers.

Only regular files are read (a FIFO or a device named as an input is refused, never opened for reading, so
nothing can hang on it), and only text: compressed, archived or binary files and text that is not UTF-8 are
refused in one line naming the file, as are .jsonl / .parquet records whose text field is not a string.
"""

from __future__ import annotations

import codecs
import contextlib
import glob
import hashlib
import json
import os
import stat
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from trainctl.data.format import DatasetError

SUFFIXES = (".txt", ".md", ".jsonl", ".parquet")  # what a folder is searched for (a named file may be any)
JSON_LINES = (".jsonl", ".json")
UNIT_BYTES = 32 << 20
SNIFF_BYTES = 8192  # read from the start of every input before anything is written
# Formats refused by their first bytes: tokenizing them as text would train on noise.
MAGIC = ((b"\x1f\x8b", "gzip-compressed", "gunzip -k"), (b"BZh", "bzip2-compressed", "bunzip2 -k"),
         (b"\xfd7zXZ\x00", "xz-compressed", "unxz -k"), (b"\x28\xb5\x2f\xfd", "zstd-compressed", "unzstd"),
         (b"PK\x03\x04", "a zip archive", "unzip"), (b"PK\x05\x06", "a zip archive", "unzip"),
         (b"%PDF-", "a PDF", "pdftotext"))
BOM = codecs.BOM_UTF8


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


JSON_KINDS = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object"}


def json_kind(value: object) -> str:
    """What a parsed JSON value is, in JSON's words (`a number`, `an object`), for one-line errors."""
    return JSON_KINDS.get(type(value), "null" if value is None else f"a {type(value).__name__}")

def expand_inputs(inputs: list[str], out: Path | None = None) -> list[Path]:
    """Files named, found in folders, or matched by globs: sorted, each once; a pattern matching nothing fails.

    Nothing inside `out` (the dataset being written) is an input, and no input is `out` or holds it.
    Every file is checked to be text (its first bytes) before anything is written.
    """
    found: set[Path] = set()
    for item in inputs:
        path = Path(item).expanduser()
        if out is not None:
            _not_out(item, path, out)
        try:
            found |= _item_files(item, path)
        except (OSError, RuntimeError) as exc:  # an entry that cannot be stat'ed or listed (permissions, length)
            raise DatasetError(f"{item}: {_short(getattr(exc, 'filename', None) or path)} cannot be read "
                               f"({getattr(exc, 'strerror', None) or exc}); make it readable, or leave it out of "
                               "the inputs") from None
        if out is not None:
            found = {p for p in found if not p.is_relative_to(out)}
        if not found:
            raise DatasetError(f"{item}: matches no input file ({', '.join(SUFFIXES)})")
    files = sorted(found)
    for file in files:
        check_text(file)
    return files


def _item_files(item: str, path: Path) -> set[Path]:
    """The input files one argument names; OSError for an entry that cannot be read (never skipped: its text
    would be missing from the dataset without a word)."""
    if path.is_file():
        return {path.resolve()}
    if path.is_dir():
        return {p.resolve() for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file()}
    if glob.has_magic(item):
        return {Path(p).resolve() for p in glob.glob(os.path.expanduser(item), recursive=True) if Path(p).is_file()}
    if os.path.lexists(path):
        raise DatasetError(f"{item}: {_kind_of(path)}, not a regular file or folder; pass text files, folders "
                           "or glob patterns")
    raise DatasetError(f"{item}: no such file or folder; pass text files, folders or glob patterns")


def too_deep(path: Path, offset: int) -> str:
    """A JSON line nested deeper than Python's parser follows (its RecursionError), in one line."""
    return (f"{path}: byte {offset}: JSON nested deeper than the reader follows (about "
            f"{sys.getrecursionlimit()} levels); flatten the record or leave it out")


def _short(path: object, keep: int = 120) -> str:
    """A path short enough for one line: its head and tail around an ellipsis."""
    text = str(path)
    return text if len(text) <= keep else f"{text[:keep // 2]}...{text[-keep // 2:]}"


def _not_out(item: str, path: Path, out: Path) -> None:
    """An input folder that is --out, or lies inside it, would read the dataset being written as text."""
    try:
        where = path.resolve()
    except (OSError, RuntimeError):  # a symlink loop: reported as not found below
        return
    if where == out or where.is_relative_to(out):
        raise DatasetError(f"--out {out}: is the input {item} or holds it; choose an --out outside the inputs")


def _kind_of(path: Path) -> str:
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        if path.is_symlink():
            return "a symlink to nothing (a missing target, or a loop)"
        return f"unreadable ({exc.strerror or exc})"
    kinds = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def open_regular(path: Path):
    """`path` opened for reading in binary, only if it is a regular file (a FIFO put there later never blocks)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read it ({exc.strerror or exc}); restore it, or leave it out") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise DatasetError(f"{path}: {_kind_of(path)}, not a regular file; pass text files")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def check_text(path: Path) -> None:
    """Refuse a compressed, archived or binary file, or one that does not start as UTF-8, from its first bytes."""
    with open_regular(path) as f:
        head = f.read(SNIFF_BYTES)
    if path.suffix == ".parquet":
        return  # binary by design; read by pyarrow
    for magic, what, tool in MAGIC:
        if head.startswith(magic):
            raise DatasetError(f"{path}: {what}, not text; decompress or convert it first ({tool}) and pass the "
                               "text")
    if head.count(0) * 100 > len(head):  # text has no NULs; UTF-16 text and binaries are full of them
        raise DatasetError(f"{path}: binary (or UTF-16) data, not UTF-8 text; convert it to UTF-8 text, or leave "
                           "it out")
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 3 or len(head) < SNIFF_BYTES:  # not a character cut at the sniff's end
            raise _not_utf8(path, exc.start) from None


def _not_utf8(path: Path, offset: int) -> DatasetError:
    return DatasetError(f"{path}: byte {offset}: not UTF-8 text; convert it to UTF-8 "
                        "(e.g. iconv -f latin1 -t utf-8), or leave it out")


def plan_units(files: list[Path], unit_bytes: int = UNIT_BYTES) -> list[Unit]:
    """Every file's pieces, in input order."""
    units: list[Unit] = []
    for path in files:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
        if path.suffix == ".parquet":
            with _parquet(path) as pf:
                groups = pf.metadata.num_row_groups
            edges = [size * g // max(groups, 1) for g in range(groups + 1)]  # for progress only
            units += [Unit(path, edges[g], edges[g + 1], row_group=g) for g in range(groups)]
        elif path.suffix in JSON_LINES:
            units += _line_pieces(path, size, unit_bytes)
        else:
            units.append(Unit(path, 0, size))
    return units


def _line_pieces(path: Path, size: int, unit_bytes: int) -> list[Unit]:
    pieces, start = [], 0
    with open_regular(path) as f:
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
    """The documents of one piece (records whose text is null or empty are skipped)."""
    if unit.row_group is not None:
        yield from _parquet_texts(unit, text_field)
        return
    data, start = unit_bytes(unit)
    if unit.path.suffix not in JSON_LINES:
        yield _decoded(data, unit.path, start)
        return
    for offset, line in json_lines(data, start):
        text = _json_text(line, text_field, unit.path, offset)
        if text:
            yield text


def unit_bytes(unit: Unit) -> tuple[bytes, int]:
    """The bytes of one text piece and the file offset of the first; a leading byte-order mark is not text."""
    with open_regular(unit.path) as f:
        f.seek(unit.start)
        data = f.read(unit.size)
    if unit.start == 0 and data.startswith(BOM):
        return data[len(BOM):], len(BOM)
    return data, unit.start


def json_lines(data: bytes, offset: int) -> Iterator[tuple[int, bytes]]:
    """(file offset, line) of each non-blank line of a .jsonl piece that starts at `offset`."""
    for line in data.split(b"\n"):
        if line.strip():
            yield offset, line
        offset += len(line) + 1


def _decoded(data: bytes, path: Path, offset: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _not_utf8(path, offset + exc.start) from None


def documents(path: Path, text_field: str) -> Iterator[str]:
    """Every document of one input file."""
    for unit in plan_units([path]):
        yield from unit_documents(unit, text_field)


def _json_text(line: bytes, field: str, path: Path, offset: int) -> str | None:
    text = _decoded(line, path, offset)
    try:
        record = json.loads(text)
    except ValueError:
        raise DatasetError(f"{path}: byte {offset}: not a JSON object per line (.jsonl)") from None
    except RecursionError:
        raise DatasetError(too_deep(path, offset)) from None
    if not isinstance(record, dict) or field not in record:
        raise DatasetError(f"{path}: byte {offset}: no text field {field!r}; name the field with --text-field")
    value = record[field]
    if value is not None and not isinstance(value, str):
        raise DatasetError(f"{path}: byte {offset}: field {field!r} is {json_kind(value)}, not a string; "
                           "name a text field with --text-field")
    problem = not_text(value) if value and "\\u" in text else None
    if problem:
        raise DatasetError(f"{path}: byte {offset}: field {field!r} holds {problem}, not text; fix the record")
    return value


def not_text(value: str) -> str | None:
    """What in a decoded JSON string is not text, or None: a JSON escape can spell what UTF-8 bytes cannot.

    An unpaired surrogate has no UTF-8 form (a tokenizer would write '?' for it), and NUL is the byte
    tokenizer's end of document (it would vanish from the text): both would train on other text than the file's.
    """
    if "\0" in value:
        return "a NUL character (\\u0000)"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "an unpaired \\uD800-\\uDFFF escape"
    return None


def _parquet_texts(unit: Unit, field: str) -> Iterator[str]:
    """A row group's texts; a column of another type is refused naming its first non-null row."""
    import pyarrow as pa

    with _parquet(unit.path) as pf:
        values = pf.read_row_group(unit.row_group, columns=[_column(pf, unit.path, field)]).column(0)
        rows_before = sum(pf.metadata.row_group(g).num_rows for g in range(unit.row_group))
    if pa.types.is_dictionary(values.type):
        values = values.cast(values.type.value_type)
    if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)
            or pa.types.is_null(values.type)):
        first = next((i for i, v in enumerate(values.is_valid().to_pylist()) if v), None)
        if first is not None:
            row = rows_before + first
            raise DatasetError(f"{unit.path}: column {field!r} row {row}: a {values.type} value, not a string; "
                               "name a text column with --text-field")
        return
    yield from (text for text in values.to_pylist() if text)


@contextlib.contextmanager
def _parquet(path: Path) -> Iterator:
    """A pyarrow ParquetFile of `path`, closed after use."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"{path}: reading .parquet needs pyarrow: pip install pyarrow") from None
    with open_regular(path) as f:
        try:
            pf = pq.ParquetFile(f)
        except Exception as exc:  # pyarrow raises its own ArrowInvalid (a ValueError) and OSErrors
            raise DatasetError(f"{path}: not a readable parquet file ({exc})") from None
        yield pf


def _column(pf, path: Path, field: str) -> str:
    names = pf.schema_arrow.names
    if field not in names:
        raise DatasetError(f"{path}: no column {field!r} (columns: {', '.join(names)}); name it with --text-field")
    return field


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open_regular(path) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
