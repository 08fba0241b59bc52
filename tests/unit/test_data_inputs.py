"""What `data prepare` reads: only regular files of UTF-8 text; everything else is one line naming the file."""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import os
import zipfile

import numpy as np
import pytest

from trainctl.data import inputs
from trainctl.data.format import DatasetError
from trainctl.data.prepare import prepare


def refused(args, out, words: str, **options) -> str:
    with pytest.raises(DatasetError) as err:
        prepare(args, out, workers=1, **options)
    message = str(err.value)
    assert words in message and "\n" not in message, message
    assert not out.exists()
    return message


def train_text(meta) -> bytes:
    parts = [np.fromfile(p, dtype=meta.token_dtype) for p in meta.shard_paths("train")]
    return bytes(np.concatenate(parts).astype(np.uint8))


TEXT = b"plain text, all of it UTF-8\n" * 20
COMPRESSED = {
    "gzip": gzip.compress(TEXT), "bzip2": bz2.compress(TEXT), "xz": lzma.compress(TEXT),
    "zstd": b"\x28\xb5\x2f\xfd" + b"\x00" * 40,
}


def zipped() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("a.txt", TEXT)
    return buf.getvalue()


@pytest.mark.parametrize("kind", [*COMPRESSED, "zip", "binary", "utf16"])
@pytest.mark.parametrize("how", ["glob", "folder", "named"])
def test_compressed_and_binary_files_are_refused_naming_the_file(tmp_path, kind, how):
    data = {"zip": zipped(), "binary": bytes(range(256)) * 8, "utf16": TEXT.decode().encode("utf-16-le"),
            **COMPRESSED}[kind]
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "good.txt").write_bytes(TEXT)
    bad = folder / "notes.txt"  # a folder search finds it by its suffix; a glob by any name
    bad.write_bytes(data)
    arg = {"glob": str(folder / "*"), "folder": str(folder), "named": str(bad)}[how]
    message = refused([arg], tmp_path / "out", str(bad))
    assert {"gzip": "gzip", "bzip2": "bzip2", "xz": "xz", "zstd": "zstd", "zip": "zip", "binary": "binary",
            "utf16": "UTF-16"}[kind] in message


def test_text_that_is_not_utf8_is_refused_with_its_byte_offset(tmp_path):
    late = tmp_path / "late.txt"
    late.write_bytes(b"a" * 20000 + "caf\xe9".encode("latin-1") + b" more")  # past the first bytes read up front
    message = refused([str(late)], tmp_path / "out", "byte 20003: not UTF-8")
    assert str(late) in message
    early = tmp_path / "early.txt"
    early.write_bytes("caf\xe9".encode("latin-1"))
    refused([str(early)], tmp_path / "out", "byte 3: not UTF-8")
    jsonl = tmp_path / "x.jsonl"
    jsonl.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    refused([str(jsonl)], tmp_path / "out", "not UTF-8")


def test_a_byte_order_mark_is_not_text(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"\xef\xbb\xbfhello")
    (tmp_path / "b.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "world"}\n')
    meta = prepare([str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")], tmp_path / "out", val_fraction=0.0,
                   workers=1)
    assert train_text(meta) == b"hello\0world\0"


@pytest.mark.parametrize(("record", "words"), [
    ({"text": 5}, "field 'text' is a number, not a string"),
    ({"text": ["a", "b"]}, "field 'text' is a list"),
    ({"body": "x"}, "no text field 'text'"),
    ("just a string", "no text field 'text'"),
])
def test_jsonl_records_without_a_string_text_are_refused(tmp_path, record, words):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps(record) + "\n")
    refused([str(path)], tmp_path / "out", f"byte {len(json.dumps({'text': 'fine'})) + 1}: {words}")


def test_jsonl_nulls_and_empty_texts_are_skipped_and_an_empty_file_has_no_text(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"text": null}\n{"text": ""}\n\n{"text": "kept"}\n')
    meta = prepare([str(path)], tmp_path / "out", val_fraction=0.0, workers=1)
    assert train_text(meta) == b"kept\0"
    (tmp_path / "empty.jsonl").write_text("")
    refused([str(tmp_path / "empty.jsonl")], tmp_path / "out2", "no text to train on")


def test_an_unpaired_surrogate_escape_is_refused(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text('{"text": "broken \\udc80 text"}\n')
    refused([str(path)], tmp_path / "out", "unpaired")


def test_very_long_lines_and_documents_are_read_whole(tmp_path):
    line = "word " * 200_000  # one 1 MB line
    (tmp_path / "long.jsonl").write_text(json.dumps({"text": line}) + "\n")
    meta = prepare([str(tmp_path / "long.jsonl")], tmp_path / "out", val_fraction=0.0, workers=1)
    assert train_text(meta) == line.encode() + b"\0"


# ---------------------------------------------------------------- parquet


@pytest.mark.parametrize(("column", "words"), [
    ([None, 1, 2], "row 1: a int64 value"),
    ([None, ["a"], None], "row 1: a list<"),
    ([None, None, b"bytes"], "row 2: a binary value"),
])
def test_a_parquet_column_of_non_strings_names_the_file_column_and_row(tmp_path, column, words):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": ["one", "two", "three"], "other": column}), path, row_group_size=1)
    message = refused([str(path)], tmp_path / "out", words, text_field="other")
    assert str(path) in message and "column 'other'" in message


def test_parquet_nulls_and_empty_strings_are_skipped(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [None, "", "kept", None]}), tmp_path / "t.parquet")
    meta = prepare([str(tmp_path / "t.parquet")], tmp_path / "out", val_fraction=0.0, workers=1)
    assert train_text(meta) == b"kept\0"


# ---------------------------------------------------------------- what is not a regular file


def test_a_named_fifo_or_device_is_refused_without_opening_it(tmp_path):
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    refused([str(fifo)], tmp_path / "out", "a named pipe (FIFO), not a regular file")
    refused(["/dev/zero"], tmp_path / "out", "a character device")
    (tmp_path / "in").mkdir()
    os.mkfifo(tmp_path / "in" / "also-a-pipe.txt")
    (tmp_path / "in" / "real.txt").write_text("real text")
    meta = prepare([str(tmp_path / "in")], tmp_path / "out", val_fraction=0.0, workers=1)  # a folder skips it
    assert train_text(meta) == b"real text\0"


def test_a_fifo_swapped_in_after_the_listing_is_never_read(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("text")
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(DatasetError, match="not a regular file"):
        inputs.open_regular(path)  # would block forever with a plain open()


def test_a_symlink_loop_in_an_input_folder_is_skipped(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "loop").symlink_to(folder)
    (folder / "self.txt").symlink_to(folder / "self.txt")
    (folder / "a.txt").write_text("text")
    meta = prepare([str(folder)], tmp_path / "out", val_fraction=0.0, workers=1)
    assert train_text(meta) == b"text\0"
    refused([str(folder / "self.txt")], tmp_path / "out2", "a symlink to nothing")


def test_a_file_that_disappears_mid_way_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    folder = tmp_path / "in"
    folder.mkdir()
    for i in range(3):
        (folder / f"{i}.txt").write_text(f"document {i}")
    real = inputs.plan_units

    def plan_then_delete(files, *args):
        units = real(files, *args)
        (folder / "2.txt").unlink()
        return units

    monkeypatch.setattr("trainctl.data.prepare_job.plan_units", plan_then_delete)
    refused([str(folder)], tmp_path / "out", f"{folder / '2.txt'}: cannot read it")


def test_a_file_changed_while_it_was_read_is_refused(tmp_path, monkeypatch):
    from trainctl.data import prepare_job

    folder = tmp_path / "in"
    folder.mkdir()
    for i in range(3):
        (folder / f"{i}.txt").write_text(f"document {i}")
    real = prepare_job.tokenize_unit

    def tokenize_then_append(unit, *args, **kwargs):
        result = real(unit, *args, **kwargs)
        if unit.path.name == "0.txt":
            with unit.path.open("a") as f:
                f.write(" and more")
        return result

    monkeypatch.setattr(prepare_job, "tokenize_unit", tokenize_then_append)
    message = refused([str(folder)], tmp_path / "out", "changed while `data prepare` read it")
    assert message.startswith(str(folder / "0.txt") + ":")


def test_a_nul_escape_in_a_text_field_is_refused(tmp_path):
    # The byte tokenizer's end of document: it would vanish from the text (and a BPE tokenizer's text has none).
    path = tmp_path / "n.jsonl"
    path.write_text('{"text": "fine text here"}\n{"text": "a\\u0000b"}\n')
    refused([str(path)], tmp_path / "out", "byte 27: field 'text' holds a NUL character")
