"""`data prepare --hf`: a Hugging Face dataset (save_to_disk folder, data file, Hub name) prepares to the same
bytes as a jsonl export of its rows, through the same record path; bad names and fields are one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import cli_in_process

datasets = pytest.importorskip("datasets")

TEXT_ROWS = [{"text": f"document {i}: " + "words and more words " * (i % 7 + 1), "n": i} for i in range(60)]
CHAT_ROWS = [{"messages": [{"role": "user", "content": f"question {i}?"},
                           {"role": "assistant", "content": f"answer {i} " * (i % 5 + 1)}]} for i in range(30)]


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """load_dataset of local files converts them into the datasets cache: the test's own, never the user's."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def _jsonl(path: Path, rows: list[dict], fields: list[str]) -> Path:
    path.write_text("".join(json.dumps({f: r[f] for f in fields}) + "\n" for r in rows), encoding="utf-8")
    return path


def _prepare(monkeypatch, capsys, out: Path, *args: str) -> str:
    code, stdout, err = cli_in_process(monkeypatch, capsys, "data", "prepare", *args, "--out", str(out),
                                       "--workers", "1", "--val-fraction", "0.1")
    assert code == 0, err
    return stdout


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.suffix in (".bin", ".mask")}


def test_a_saved_folder_and_a_parquet_file_prepare_as_their_jsonl(tmp_path, monkeypatch, capsys):
    dataset = datasets.Dataset.from_list(TEXT_ROWS)
    dataset.save_to_disk(str(tmp_path / "saved"))
    dataset.to_parquet(str(tmp_path / "rows.parquet"))
    _prepare(monkeypatch, capsys, tmp_path / "want", str(_jsonl(tmp_path / "rows.jsonl", TEXT_ROWS, ["text"])))
    want = _files(tmp_path / "want")
    assert {"train-00000.bin", "val-00000.bin"} <= set(want)
    for name, source in (("saved", tmp_path / "saved"), ("parquet", tmp_path / "rows.parquet")):
        _prepare(monkeypatch, capsys, tmp_path / f"out-{name}", "--hf", str(source))
        assert _files(tmp_path / f"out-{name}") == want, name


def test_chat_rows_keep_the_jsonl_masks_and_a_dataset_dict_split_is_chosen(tmp_path, monkeypatch, capsys):
    train = datasets.Dataset.from_list(CHAT_ROWS)
    other = datasets.Dataset.from_list(CHAT_ROWS[:3])
    datasets.DatasetDict({"train": other, "sft": train}).save_to_disk(str(tmp_path / "saved"))
    chat = ("--format", "chat", "--chat-template", "chatml")
    _prepare(monkeypatch, capsys, tmp_path / "want", str(_jsonl(tmp_path / "c.jsonl", CHAT_ROWS, ["messages"])),
             *chat)
    _prepare(monkeypatch, capsys, tmp_path / "got", "--hf", str(tmp_path / "saved"), "--split", "sft", *chat)
    want = _files(tmp_path / "want")
    assert any(name.endswith(".mask") for name in want)
    assert _files(tmp_path / "got") == want


def test_the_export_is_removed_and_row_order_kept(tmp_path, monkeypatch, capsys):
    rows = list(reversed(TEXT_ROWS))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    _prepare(monkeypatch, capsys, tmp_path / "want", str(_jsonl(tmp_path / "r.jsonl", rows, ["text"])))
    _prepare(monkeypatch, capsys, tmp_path / "reversed", "--hf", str(tmp_path / "saved"))
    _prepare(monkeypatch, capsys, tmp_path / "forward", str(_jsonl(tmp_path / "f.jsonl", TEXT_ROWS, ["text"])))
    assert _files(tmp_path / "reversed") == _files(tmp_path / "want")
    assert _files(tmp_path / "reversed") != _files(tmp_path / "forward")  # order is what decides the bytes
    import tempfile
    assert not list(Path(tempfile.gettempdir()).glob("*trainctl-hf-*"))


@pytest.mark.parametrize("args, words", [
    (["--text-field", "body"], ["no field 'body'", "fields: text, n"]),
    (["--format", "instruction"], ["no field 'prompt'", "fields: text, n"]),
    (["--split", "test"], ["--split test", "train"]),
])
def test_a_missing_field_or_split_is_one_line(tmp_path, monkeypatch, capsys, args, words):
    datasets.DatasetDict({"train": datasets.Dataset.from_list(TEXT_ROWS)}).save_to_disk(str(tmp_path / "saved"))
    code, _, err = cli_in_process(monkeypatch, capsys, "data", "prepare", "--hf", str(tmp_path / "saved"), *args,
                                  "--out", str(tmp_path / "out"))
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and all(w in err for w in words), err
    assert not (tmp_path / "out").exists()


def test_an_uncached_hub_name_offline_says_how_to_fetch_it(tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # Both libraries read the variable once, at import (a CLI process sets it before): say it to them here too.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    code, _, err = cli_in_process(monkeypatch, capsys, "data", "prepare", "--hf", "someorg/not-cached",
                                  "--out", str(tmp_path / "out"))
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "offline" in err and "load_dataset('someorg/not-cached')" in err


@pytest.mark.parametrize("args, words", [
    ([], ["--hf NAME_OR_PATH"]),
    (["a.txt", "--hf", "x"], ["choose one"]),
    (["a.txt", "--split", "test"], ["--split", "only with --hf"]),
    (["--hf", "a.txt"], ["a .txt file"]),
])
def test_inputs_and_hf_options_are_checked(tmp_path, monkeypatch, capsys, args, words):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("some text\n")
    code, _, err = cli_in_process(monkeypatch, capsys, "data", "prepare", *args, "--out", str(tmp_path / "out"))
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and all(w in err for w in words), err


def test_datasets_is_imported_by_the_hf_reader_only():
    """The launcher and every other path stay free of `datasets` (and whatever it pulls in): one module reads it,
    reached by a lazy import from api.prepare_data only when --hf is given."""
    from tests.unit.test_layering import ROOT, third_party_imports

    found = third_party_imports(ROOT.rglob("*.py"))
    assert [where.split(":")[0] for where in found.get("datasets", [])] == ["trainctl/data/hf_source.py"]
    hf_users = [p for p in ROOT.rglob("*.py") if "hf_source" in p.read_text() and p.name != "hf_source.py"]
    assert [p.relative_to(ROOT).as_posix() for p in hf_users] == ["api/tools.py"]


def test_the_same_rows_export_to_the_same_input_listing(tmp_path):
    """A prepare stopped by Ctrl-C continues when its inputs list the same (path, size, mtime): the export of the
    same rows must, and other rows must not."""
    from trainctl.data import hf_source
    from trainctl.data.prepare_job import input_listing

    datasets.Dataset.from_list(TEXT_ROWS).save_to_disk(str(tmp_path / "a"))
    datasets.Dataset.from_list(TEXT_ROWS[1:]).save_to_disk(str(tmp_path / "b"))
    listings = []
    for name in ("a", "a", "b"):
        with hf_source.exported(str(tmp_path / name), "train", None, ["text"]) as rows:
            listings.append(input_listing([rows]))
    assert listings[0] == listings[1] != listings[2]


def test_preference_rows_with_the_prompt_inside_the_conversations(tmp_path, monkeypatch, capsys):
    """TRL's implicit-prompt layout (chosen and rejected conversations, no prompt column) reads as its jsonl."""
    rows = [{"chosen": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "yes"}],
             "rejected": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "no"}]}
            for i in range(20)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    pref = ("--format", "preference", "--chat-template", "chatml")
    _prepare(monkeypatch, capsys, tmp_path / "want", str(_jsonl(tmp_path / "p.jsonl", rows, ["chosen", "rejected"])),
             *pref)
    _prepare(monkeypatch, capsys, tmp_path / "got", "--hf", str(tmp_path / "saved"), *pref)
    assert _files(tmp_path / "got") == _files(tmp_path / "want")
