"""Long documents are cut into pieces for the train/val split, so one big file still gets a val split; a dataset
with an empty split is refused before anything starts."""

from __future__ import annotations

import random

import numpy as np
import pytest

from trainctl.config.compose import compose
from trainctl.config.errors import ConfigError
from trainctl.config.validate import resolve
from trainctl.data.prepare import prepare
from trainctl.data.split import PIECE_CHARS, pieces, stretches


def book(paragraphs: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = ["river", "stone", "light", "garden", "window", "paper", "signal", "orange"]
    return "\n\n".join("\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(8))
                       for _ in range(paragraphs))


def streams(meta) -> dict[str, list[str]]:
    """Each split's EOS-terminated stretches of text (byte tokens)."""
    out = {}
    for split in ("train", "val"):
        parts = [np.fromfile(p, dtype=meta.token_dtype) for p in meta.shard_paths(split)]
        raw = bytes(np.concatenate(parts).astype(np.uint8)) if parts else b""
        assert raw.endswith(b"\0") or not raw  # every stretch ends with EOS
        out[split] = [s.decode() for s in raw.split(b"\0")[:-1]]
    return out


def test_pieces_cut_at_paragraphs_then_lines_then_spaces_and_join_back():
    text = book(200)
    cut = pieces(text, 2000)
    assert "".join(cut) == text and len(cut) > 10
    assert all(len(p) <= 2000 for p in cut) and all(p.endswith("\n\n") for p in cut[:-1])
    one_paragraph = text.replace("\n\n", "\n")
    assert all(p.endswith("\n") for p in pieces(one_paragraph, 2000)[:-1])
    one_line = text.replace("\n", " ")
    assert all(p.endswith(" ") for p in pieces(one_line, 2000)[:-1])
    solid = "x" * 5000
    assert pieces(solid, 2000) == ["x" * 2000, "x" * 2000, "x" * 1000]
    assert pieces("short", 2000) == ["short"]


def test_adjacent_pieces_of_one_split_stay_one_stretch():
    text = book(300)
    got = list(stretches([text, "a short note"], seed=0, val_fraction=0.3, budget=2000))
    assert {s for s, _, _ in got} == {"train", "val"}
    assert all(a[0] != b[0] for a, b in zip(got, got[1:-1], strict=False))  # within the book, splits alternate
    assert "".join(t for _, t, _ in got[:-1]) == text and got[-1][1] == "a short note"
    assert sum(n for _, _, n in got) == len(pieces(text, 2000)) + 1


def test_last_to_forces_the_last_piece():
    got = list(stretches(["one", "two"], seed=0, val_fraction=0.0, last_to="val"))
    assert got == [("train", "one", 1), ("val", "two", 1)]


def test_one_big_file_gets_both_splits_and_no_eos_inside_a_stretch(tmp_path):
    text = book(600)
    assert len(text) > 10 * PIECE_CHARS
    (tmp_path / "book.txt").write_text(text)
    meta = prepare([str(tmp_path / "book.txt")], tmp_path / "out", val_fraction=0.1, workers=1)
    got = streams(meta)
    assert got["train"] and got["val"]
    assert all(s in text for s in got["train"] + got["val"])  # each stretch is contiguous text of the book
    assert sum(len(s) for s in got["train"] + got["val"]) == len(text)  # every character once, EOS only between


def test_a_one_file_corpus_whose_pieces_all_fall_in_train_holds_the_last_one_out(tmp_path):
    text = book(120)
    (tmp_path / "book.txt").write_text(text)
    meta = prepare([str(tmp_path / "book.txt")], tmp_path / "out", val_fraction=1e-9, workers=1)
    got = streams(meta)
    assert got["val"] == [pieces(text)[-1]] and "".join(got["train"]) + got["val"][0] == text


def test_a_one_piece_corpus_that_hashes_to_val_still_trains(tmp_path):
    (tmp_path / "note.txt").write_text("a single short note")
    meta = prepare([str(tmp_path / "note.txt")], tmp_path / "out", val_fraction=0.999, workers=1)
    assert streams(meta) == {"train": ["a single short note"], "val": []}


# ---------------------------------------------------------------- refused at plan time


def composed(*overrides):
    return resolve(compose(["recipe=tiny_cpu", "data=memmap", "train.seq_len=32", *overrides]))


def test_an_empty_val_split_is_refused_when_eval_reads_it(tmp_path):
    folder = tmp_path / "text"
    folder.mkdir()
    for i in range(4):
        (folder / f"{i}.txt").write_text(f"document {i} " * 20)
    prepare([str(folder)], tmp_path / "d", val_fraction=0.0, workers=1)
    with pytest.raises(ConfigError) as err:
        composed(f"data.datasets=[{tmp_path / 'd'}]", "train.eval_every=10")
    (line,) = err.value.problems
    assert "val split is empty" in line and "--val-fraction" in line and "train.eval_every=0" in line
    composed(f"data.datasets=[{tmp_path / 'd'}]", "train.eval_every=0")


def test_a_val_split_shorter_than_a_sample_names_the_fixes(tmp_path):
    (tmp_path / "book.txt").write_text(book(60))
    prepare([str(tmp_path / "book.txt")], tmp_path / "d", val_fraction=1e-9, workers=1)
    with pytest.raises(ConfigError) as err:
        composed(f"data.datasets=[{tmp_path / 'd'}]", "train.seq_len=100000", "model.max_seq_len=100000")
    assert any("val split has" in p and "--val-fraction" in p for p in err.value.problems)
