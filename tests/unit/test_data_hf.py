"""`data prepare --hf`: a Hugging Face dataset (save_to_disk folder, data file, Hub name) prepares to the same
bytes as a jsonl export of its rows, through the same record path; bad names and fields are one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import cli_in_process
from tests.unit.test_data_resume import stop_after
from trainctl.data.outdir import STATE_FILE

datasets = pytest.importorskip("datasets")

TEXT_ROWS = [{"text": f"document {i}: " + "words and more words " * (i % 7 + 1), "n": i} for i in range(60)]
CHAT_ROWS = [{"messages": [{"role": "user", "content": f"question {i}?"},
                           {"role": "assistant", "content": f"answer {i} " * (i % 5 + 1)}]} for i in range(30)]


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """load_dataset of local files converts them into the datasets cache: the test's own, never the user's."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    # The tests' own save_to_disk would draw progress bars on the stderr the one-line checks read (the product
    # turns them off when it loads, so whether they show depended on which test ran first in the process).
    datasets.disable_progress_bars()


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
    """The launcher and every other path stay free of `datasets` (and whatever it pulls in): two modules read it,
    hf_source reached by a lazy import from api.prepare_data only when --hf is given, and hf_stream (data=hf, which
    the launch preflight imports lazily for data.kind=hf only)."""
    from tests.unit.test_layering import ROOT, third_party_imports

    found = third_party_imports(ROOT.rglob("*.py"))
    readers = sorted({where.split(":")[0] for where in found.get("datasets", [])})
    assert readers == ["trainctl/data/hf_source.py", "trainctl/data/hf_stream.py"]
    hf_users = [p for p in ROOT.rglob("*.py") if "hf_source" in p.read_text() and p.name != "hf_source.py"]
    assert sorted(p.relative_to(ROOT).as_posix() for p in hf_users) == ["api/tools.py", "data/hf_stream.py"]
    stream_users = [p for p in ROOT.rglob("*.py") if "hf_stream" in p.read_text() and p.name != "hf_stream.py"]
    assert sorted(p.relative_to(ROOT).as_posix() for p in stream_users) == ["config/hf_data_check.py",
                                                                           "train/loop/stream.py"]


def test_an_interrupted_hf_prepare_resumes_to_the_same_bytes(tmp_path):
    """A prepare stopped by Ctrl-C continues when run again: its export lies in a folder of its own each time, and
    the fingerprint lists it by its name (the rows' sha256), size and mtime."""
    from trainctl import api

    datasets.Dataset.from_list(TEXT_ROWS).save_to_disk(str(tmp_path / "saved"))
    common = dict(hf=str(tmp_path / "saved"), val_fraction=0.2, workers=1, unit_bytes=512)
    reference = api.prepare_data([], tmp_path / "ref", **common)
    with pytest.raises(KeyboardInterrupt):
        api.prepare_data([], tmp_path / "out", progress=stop_after(2), **common)
    assert (tmp_path / "out" / STATE_FILE).is_file() and not (tmp_path / "out" / "meta.json").exists()
    resumed = api.prepare_data([], tmp_path / "out", **common)  # "other inputs or options" if it did not match
    assert _files(tmp_path / "out") == _files(tmp_path / "ref") and resumed.splits == reference.splits


def test_two_exports_of_the_same_rows_at_once_share_nothing(tmp_path):
    """Two identical --hf prepares at once: each reads its own file, and the first to finish removes only its own."""
    from trainctl.data import hf_source

    datasets.Dataset.from_list(TEXT_ROWS).save_to_disk(str(tmp_path / "a"))
    with hf_source.exported(str(tmp_path / "a"), "train", None, ["text"]) as first:
        text = first.read_text(encoding="utf-8")
        with hf_source.exported(str(tmp_path / "a"), "train", None, ["text"]) as second:
            assert second != first and second.name == first.name  # same rows, same name; another folder
            assert second.read_text(encoding="utf-8") == text
        assert not second.parent.exists()
        assert first.read_text(encoding="utf-8") == text, "the other export removed this one's file"
    assert not first.parent.exists()


def test_the_export_is_removed_when_the_prepare_fails(tmp_path):
    from trainctl.data import hf_source

    datasets.Dataset.from_list(TEXT_ROWS).save_to_disk(str(tmp_path / "a"))
    with pytest.raises(RuntimeError), hf_source.exported(str(tmp_path / "a"), "train", None, ["text"]) as rows:
        assert rows.is_file()
        raise RuntimeError("the prepare failed")
    assert not rows.parent.exists()


def _zero_rows(tmp_path: Path, kind: str) -> tuple[Path, list[str], Path]:
    """A dataset with no rows, saved as `kind`: (what --hf names, extra arguments, the path the error names)."""
    empty = datasets.Dataset.from_dict({"text": []})
    if kind == "saved":
        empty.save_to_disk(str(tmp_path / "saved"))
        return tmp_path / "saved", [], tmp_path / "saved"
    if kind == "dict":
        full = datasets.Dataset.from_list(TEXT_ROWS)
        datasets.DatasetDict({"train": full, "empty": empty}).save_to_disk(str(tmp_path / "saved"))
        return tmp_path / "saved", ["--split", "empty"], tmp_path / "saved" / "empty"
    path = tmp_path / f"rows.{kind}"
    if kind == "parquet":
        empty.to_parquet(str(path))
    else:
        path.write_text("text\n" if kind == "csv" else "")
    return path, [], path


@pytest.mark.parametrize("kind", ["saved", "dict", "parquet", "csv", "jsonl"])
def test_a_dataset_without_rows_is_one_line_naming_it(tmp_path, monkeypatch, capsys, kind):
    name, args, where = _zero_rows(tmp_path, kind)
    code, _, err = cli_in_process(monkeypatch, capsys, "data", "prepare", "--hf", str(name), *args,
                                  "--out", str(tmp_path / "out"))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"{where} has no rows" in lines[0] and "Error" not in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_a_dataset_dict_with_an_empty_split_still_gives_its_other_splits(tmp_path, monkeypatch, capsys):
    """datasets' loader fails on a whole DatasetDict when any split is empty: the chosen split is read alone."""
    name, _, _ = _zero_rows(tmp_path, "dict")
    _prepare(monkeypatch, capsys, tmp_path / "want", str(_jsonl(tmp_path / "rows.jsonl", TEXT_ROWS, ["text"])))
    _prepare(monkeypatch, capsys, tmp_path / "got", "--hf", str(name), "--split", "train")
    assert _files(tmp_path / "got") == _files(tmp_path / "want")


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
