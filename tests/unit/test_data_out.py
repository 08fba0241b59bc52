"""--out of `data prepare`: refused in one line when no dataset can go there, and put back as it was when a
prepare is refused part-way (so the command its error suggests then works)."""

from __future__ import annotations

import json
import os

import pytest

from trainctl.data.format import DatasetError
from trainctl.data.prepare import prepare


@pytest.fixture
def text_dir(tmp_path):
    folder = tmp_path / "text"
    folder.mkdir()
    for i in range(6):
        (folder / f"doc{i}.txt").write_text(f"document number {i} " * 5)
    return folder


def one_line(call) -> str:
    with pytest.raises(DatasetError) as err:
        call()
    assert "\n" not in str(err.value)
    return str(err.value)


# ---------------------------------------------------------------- a refusal part-way leaves nothing behind


def bad_record_in_the_middle(folder):
    lines = [json.dumps({"text": f"record {i}"}) for i in range(40)]
    lines[25] = json.dumps({"text": 25})
    (folder / "m.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "m.jsonl"


@pytest.mark.parametrize("tokenizer", ["bytes", "train"])
@pytest.mark.parametrize("existing", [False, True])
def test_a_bad_record_part_way_leaves_the_folder_as_it_was(tmp_path, tokenizer, existing):
    if tokenizer == "train":
        pytest.importorskip("tokenizers")
    source = bad_record_in_the_middle(tmp_path)
    out = tmp_path / "parent" / "out"
    if existing:
        out.mkdir(parents=True)
    options = dict(train_tokenizer=True, vocab_size=270) if tokenizer == "train" else {}
    # Small units: several are written before the bad one (with a trained tokenizer, its training reads it first).
    problem = one_line(lambda: prepare([str(source)], out, workers=1, unit_bytes=200, **options))
    assert "is a number, not a string" in problem
    if existing:
        assert out.is_dir() and list(out.iterdir()) == []
    else:
        assert not (tmp_path / "parent").exists()  # the parent it made is gone too
    source.write_text(source.read_text().replace('"text": 25', '"text": "25"'))  # fixed: the same --out works
    meta = prepare([str(source)], out, workers=1, unit_bytes=200, **options)
    assert meta.splits["train"].documents + meta.splits["val"].documents == 40


def test_a_bad_tokenizer_leaves_nothing(tmp_path, text_dir):
    (tmp_path / "tok.json").write_text('{"not": "a tokenizer"}')
    out = tmp_path / "out"
    assert "not a Hugging Face tokenizer.json" in one_line(
        lambda: prepare([str(text_dir)], out, tokenizer=str(tmp_path / "tok.json"), workers=1))
    assert not out.exists()


def test_a_vocab_too_small_to_train_leaves_nothing(tmp_path, text_dir):
    pytest.importorskip("tokenizers")
    assert "--vocab-size 100" in one_line(
        lambda: prepare([str(text_dir)], tmp_path / "out", train_tokenizer=True, vocab_size=100, workers=1))
    assert not (tmp_path / "out").exists()


def test_no_text_in_a_folder_of_yours_leaves_it_there(tmp_path):
    (tmp_path / "blank.txt").write_text("  \n")
    (tmp_path / "mine").mkdir()
    assert "no text to train on" in one_line(lambda: prepare([str(tmp_path / "blank.txt")], tmp_path / "mine",
                                                              workers=1))
    assert (tmp_path / "mine").is_dir() and list((tmp_path / "mine").iterdir()) == []


def test_an_interrupted_prepare_is_kept_for_the_same_command(tmp_path, text_dir):
    def stop(done, total):
        if done:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare([str(text_dir)], tmp_path / "out", workers=1, progress=stop)
    assert (tmp_path / "out" / ".prepare-state.json").is_file()


# ---------------------------------------------------------------- where --out cannot be


def test_out_under_a_regular_file_is_one_line(tmp_path, text_dir):
    (tmp_path / "file").write_text("x")
    message = one_line(lambda: prepare([str(text_dir)], tmp_path / "file" / "sub" / "out", workers=1))
    assert f"{tmp_path / 'file'} is a file, not a folder" in message
    assert (tmp_path / "file").read_text() == "x"


def test_out_a_symlink_to_a_file_or_a_loop(tmp_path, text_dir):
    (tmp_path / "file").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "file")
    assert "is a file; choose a folder" in one_line(lambda: prepare([str(text_dir)], tmp_path / "link", workers=1))
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    assert "--out" in one_line(lambda: prepare([str(text_dir)], tmp_path / "loop", workers=1))
    assert (tmp_path / "file").read_text() == "x"


def test_out_equal_to_or_holding_an_input_folder_is_refused(tmp_path, text_dir):
    before = sorted(p.name for p in text_dir.iterdir())
    assert "is the input" in one_line(lambda: prepare([str(text_dir)], text_dir, workers=1))
    assert "is the input" in one_line(lambda: prepare([str(text_dir)], tmp_path, workers=1))
    assert sorted(p.name for p in text_dir.iterdir()) == before
    meta = prepare([str(text_dir)], text_dir / "tokens", workers=1)  # inside an input folder: fine
    assert meta.splits["train"].documents + meta.splits["val"].documents == 6


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_out_in_a_folder_without_write_permission(tmp_path, text_dir):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    assert "no permission to write" in one_line(lambda: prepare([str(text_dir)], locked / "out", workers=1))


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_out_where_no_folder_can_be_made(text_dir):
    message = one_line(lambda: prepare([str(text_dir)], "/proc/self/trainctl-no/out", workers=1))
    assert message.startswith("--out /proc/self/trainctl-no/out:")


# ---------------------------------------------------------------- options


@pytest.mark.parametrize(("options", "words"), [
    (dict(workers=0), "--workers 0"), (dict(workers=-3), "--workers -3"),
    (dict(shard_tokens=10**30), "--shard-tokens"), (dict(shard_tokens=0), "--shard-tokens"),
    (dict(val_fraction=float("nan")), "--val-fraction"), (dict(val_fraction=1.5), "--val-fraction"),
    (dict(vocab_size=512), "only with --train-tokenizer"),
    (dict(train_tokenizer=True, vocab_size=300, tokenizer="x.json"), "choose one"),
    (dict(train_tokenizer=True, vocab_size=300, eos_token="</s>"), "leave --eos-token out"),
    (dict(tokenizer="missing.json"), "no such file"),
])
def test_bad_options_are_one_line_and_write_nothing(tmp_path, text_dir, options, words):
    assert words in one_line(lambda: prepare([str(text_dir)], tmp_path / "out", **options))
    assert not (tmp_path / "out").exists()
