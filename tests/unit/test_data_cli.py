"""`trainctl data prepare` as a user runs it: refusals are one line with exit code 2; Ctrl-C then the same command
finishes to the bytes of an uninterrupted run."""

from __future__ import annotations

import gzip
import json
import os
import random
import signal

import pytest

from tests.helpers import cli_in_process, start_cli, wait_for


def answer(monkeypatch, capsys, *argv: str) -> tuple[int, str]:
    code, _, err = cli_in_process(monkeypatch, capsys, "data", "prepare", *argv)
    return code, err


@pytest.mark.parametrize("case", ["under-a-file", "gzip", "empty-out", "workers"])
def test_refusals_are_one_line_and_exit_2(tmp_path, monkeypatch, capsys, case):
    (tmp_path / "a.txt").write_text("some text")
    (tmp_path / "file").write_text("x")
    (tmp_path / "b.txt.gz").write_bytes(gzip.compress(b"compressed text"))
    argv, words = {
        "under-a-file": ([str(tmp_path / "a.txt"), "--out", str(tmp_path / "file" / "out")], "is a file"),
        "gzip": ([str(tmp_path / "*"), "--out", str(tmp_path / "out")], "b.txt.gz: gzip-compressed"),
        "empty-out": ([str(tmp_path / "a.txt"), "--out", ""], "--out: empty"),
        "workers": ([str(tmp_path / "a.txt"), "--out", str(tmp_path / "out"), "--workers", "0"], "--workers 0"),
    }[case]
    code, err = answer(monkeypatch, capsys, *argv)
    assert code == 2 and err.startswith("error: ") and words in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists() and (tmp_path / "file").read_text() == "x"


def test_an_empty_val_split_is_said_after_the_summary(tmp_path, monkeypatch, capsys):
    (tmp_path / "a.txt").write_text("some text")
    code, out, _ = cli_in_process(monkeypatch, capsys, "data", "prepare", str(tmp_path / "a.txt"), "--out",
                                  str(tmp_path / "out"), "--val-fraction", "0")
    assert code == 0
    assert "no val split: train with train.eval_every=0" in out


# ---------------------------------------------------------------- with processes


def corpus(root, files: int = 240, words: int = 12000):
    """Text files (one unit each) and a word-level tokenizer.json: a prepare of a few seconds on 2 cores."""
    rng = random.Random(0)
    vocab = [f"w{i}" for i in range(50)]
    (root / "text").mkdir()
    for i in range(files):
        (root / "text" / f"{i:03d}.txt").write_text(" ".join(rng.choice(vocab) for _ in range(words)))
    ids = {"<unk>": 0, "</s>": 1, **{w: 2 + k for k, w in enumerate(vocab)}}
    tok = {"version": "1.0", "added_tokens": [{"id": 1, "content": "</s>", "single_word": False, "lstrip": False,
                                               "rstrip": False, "normalized": False, "special": True}],
           "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
           "model": {"type": "WordLevel", "vocab": ids, "unk_token": "<unk>"}}
    (root / "tok.json").write_text(json.dumps(tok))
    return ["data", "prepare", str(root / "text"), "--tokenizer", str(root / "tok.json"), "--workers", "2",
            "--shard-tokens", "500000"]


trainctl = start_cli


def units_done(out) -> int:
    try:  # JSON lines: a header, then one line per unit done
        return max(len((out / ".prepare-state.json").read_text().splitlines()) - 1, 0)
    except OSError:
        return 0


@pytest.mark.cli
def test_ctrl_c_then_the_same_command_gives_the_bytes_of_an_uninterrupted_run(tmp_path):
    args = corpus(tmp_path)
    clean = trainctl(*args, "--out", "clean", cwd=tmp_path)
    assert clean.wait(timeout=300) == 0, clean.stderr.read()
    # Ctrl-C at a terminal signals the whole foreground group: the CLI and its worker processes.
    first = trainctl(*args, "--out", "out", cwd=tmp_path, start_new_session=True)
    wait_for(lambda: units_done(tmp_path / "out") >= 3, "three units written", timeout=120, proc=first)
    os.killpg(first.pid, signal.SIGINT)
    _, err = first.communicate(timeout=120)
    assert first.returncode == 130 and "Traceback" not in err and "run the same command again" in err, err
    assert 3 <= units_done(tmp_path / "out") < 240 and not (tmp_path / "out" / "meta.json").exists()
    again = trainctl(*args, "--out", "out", cwd=tmp_path)
    assert again.wait(timeout=300) == 0, again.stderr.read()
    clean_files = {p.name: p.read_bytes() for p in (tmp_path / "clean").iterdir() if p.name != "meta.json"}
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir() if p.name != "meta.json"} == clean_files
    metas = [json.loads((tmp_path / d / "meta.json").read_text()) for d in ("clean", "out")]
    assert [{k: v for k, v in m.items() if k != "created"} for m in metas][0] == \
        {k: v for k, v in metas[1].items() if k != "created"}


@pytest.mark.cli
def test_a_refusal_in_a_worker_process_leaves_nothing(tmp_path):
    from trainctl.data.format import DatasetError
    from trainctl.data.prepare import prepare

    for i in range(6):
        (tmp_path / f"{i}.jsonl").write_text(json.dumps({"text": f"record {i}"}) + "\n")
    (tmp_path / "4.jsonl").write_text('{"text": ["not", "text"]}\n')
    with pytest.raises(DatasetError, match="4.jsonl: byte 0: field 'text' is a list"):
        prepare([str(tmp_path / "*.jsonl")], tmp_path / "out", workers=2)
    assert not (tmp_path / "out").exists()
