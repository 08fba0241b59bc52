"""`data=hf`: a Hugging Face dataset tokenized on the fly, packed, split across data-parallel ranks, and resumed
exactly from the state each rank saves; the keys checked in one line each; a Hub name read from the cache offline."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import cli_in_process
from tests.hf_datasets import cache_hub_dataset, offline
from trainctl.config.compose import compose
from trainctl.config.errors import ConfigError
from trainctl.config.hf_data_check import hf_dataset_problems
from trainctl.config.schema import DataConfig
from trainctl.config.validate import resolve
from trainctl.train.loop.sources import DataError
from trainctl.train.loop.stream import StreamBatches

datasets = pytest.importorskip("datasets")

ROWS = [{"text": f"document {i}: " + "some words " * (i % 6 + 1), "n": i} for i in range(30)]


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    datasets.disable_progress_bars()


def _sources(tmp_path: Path) -> dict[str, DataConfig]:
    """The same rows as a save_to_disk folder (read whole) and as a jsonl file (streamed)."""
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                          "validation": datasets.Dataset.from_list(ROWS[:8])}).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    common = dict(kind="hf", tokenizer="bytes", vocab_size=256)
    return {"saved": DataConfig(source=str(tmp_path / "saved"), **common),
            "streamed": DataConfig(source=str(tmp_path / "rows.jsonl"), streaming=True, **common)}


def _batches(cfg: DataConfig, rank: int, world: int = 2, split: str = "train") -> StreamBatches:
    return StreamBatches(cfg, split, 15, 4 * world, 2, 2, rank, world, 0)  # windows of 16 tokens, 4 per step


def _tokens(steps: list) -> list[bytes]:
    """Each micro-batch's windows (inputs and the last target) as bytes."""
    return [bytes(torch.cat([inputs, targets[:, -1:]], 1).numpy().astype(np.uint8))
            for step in steps for inputs, targets in step]


@pytest.mark.parametrize("which", ["saved", "streamed"])
def test_a_stream_resumed_from_its_state_reads_what_an_uninterrupted_one_reads(tmp_path, which):
    cfg = _sources(tmp_path)[which]
    for rank in (0, 1):
        straight = _batches(cfg, rank)
        whole = [straight.micro_batches(s) for s in range(40)]  # past the end of this rank's rows: a second epoch
        assert straight._stream.epoch >= 1
        stopped = _batches(cfg, rank)
        first = [stopped.micro_batches(s) for s in range(13)]
        state = json.loads(json.dumps(stopped.state_dict()))  # what a checkpoint keeps survives a round trip
        resumed = _batches(cfg, rank)
        resumed.load_state_dict(state)
        rest = [resumed.micro_batches(s) for s in range(13, 40)]
        assert _tokens(first + rest) == _tokens(whole)
        inputs, targets = whole[0][0]
        assert inputs.shape == targets.shape == (2, 15) and (inputs[:, 1:] == targets[:, :-1]).all()


def test_ranks_read_their_own_rows_packed_with_an_end_of_document_byte(tmp_path):
    cfg = _sources(tmp_path)["saved"]
    ranks = [_batches(cfg, rank) for rank in (0, 1)]
    text = [b"".join(_tokens([batches.micro_batches(s) for s in range(3)])) for batches in ranks]
    assert text[0].startswith(b"document 0: ") and text[1].startswith(b"document 15: ")  # each rank its half
    assert b"\0document 1: " in text[0] and b"document 15" not in text[0]


def test_the_held_out_split_gives_the_same_windows_at_every_eval(tmp_path):
    cfg = DataConfig(**{**_sources(tmp_path)["saved"].__dict__, "val_split": "validation"})
    val = _batches(cfg, 0, 1, "val")
    first, again = val.eval_batches(2), val.eval_batches(2)
    assert _tokens([first]) == _tokens([again]) and _tokens([first])[0].startswith(b"document 0: ")


@pytest.mark.parametrize("change, key", [
    (dict(text_field="body"), "data.text_field=body"),
    (dict(split="test"), "data.split=test"),
    (dict(source="/nowhere/at/all.jsonl"), "data.source=/nowhere/at/all.jsonl"),
    (dict(val_split="nope"), "data.val_split=nope"),
])
def test_a_missing_dataset_split_or_field_is_one_line_naming_the_key(tmp_path, change, key):
    cfg = DataConfig(**{**_sources(tmp_path)["saved"].__dict__, **change})
    problems = hf_dataset_problems(cfg, 256)
    assert len(problems) == 1 and problems[0].startswith(key) and "\n" not in problems[0], problems
    with pytest.raises(DataError, match=key.split("=")[0]):
        _batches(cfg, 0, 1, "val" if "val_split" in change else "train").micro_batches(0)


def test_a_dataset_with_fewer_rows_than_ranks_is_refused_on_the_empty_rank(tmp_path):
    datasets.Dataset.from_list(ROWS[:1]).save_to_disk(str(tmp_path / "one"))
    cfg = DataConfig(kind="hf", source=str(tmp_path / "one"), tokenizer="bytes", vocab_size=256)
    with pytest.raises(DataError, match="no rows for this data-parallel rank"):
        _batches(cfg, 1).micro_batches(0)


@pytest.mark.parametrize("overrides, words", [
    ([], ["data.source: required for data=hf"]),
    (["data.source=x", "train.eval_every=5"], ["data.val_split", "train.eval_every=0"]),
    (["data.source=x", "train.eval_every=0", "data.tokenizer="], ["data.tokenizer", "model names no tokenizer"]),
    (["data.source=x", "train.eval_every=0", "data.tokenizer=/no/such/folder"], ["data.tokenizer=/no/such/folder"]),
])
def test_the_keys_are_checked_when_the_config_is_composed(overrides, words):
    with pytest.raises(ConfigError) as err:
        resolve(compose(["data=hf", "data.tokenizer=bytes", *overrides]))
    assert all(w in str(err.value) for w in words), str(err.value)


def test_a_composed_config_names_the_tokenizer_the_workers_read(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    cfg = resolve(compose(["data=hf", "data.source=x", "train.eval_every=0", f"data.tokenizer={tmp_path}"]))
    assert cfg.data.tokenizer == str(tmp_path / "tokenizer.json")
    cfg = resolve(compose(["data=hf", "data.source=x", "train.eval_every=0", "data.tokenizer=bytes"]))
    assert cfg.data.tokenizer == "bytes"


def test_a_hub_dataset_in_the_cache_is_read_by_name_offline(tmp_path, monkeypatch, capsys):
    cache = offline(monkeypatch, tmp_path / "hf-home")
    cache_hub_dataset(cache, "acme/tiny", {"train": ROWS, "validation": ROWS[:8]})
    code, _, err = cli_in_process(monkeypatch, capsys, "data", "prepare", "--hf", "acme/tiny", "--out",
                                  str(tmp_path / "prepared"), "--workers", "1", "--val-fraction", "0.1")
    assert code == 0, err
    meta = json.loads((tmp_path / "prepared" / "meta.json").read_text())
    assert meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"] == sum(
        len(r["text"].encode()) + 1 for r in ROWS)
    for streaming in (False, True):
        cfg = DataConfig(kind="hf", source="acme/tiny", tokenizer="bytes", vocab_size=256, streaming=streaming,
                         val_split="validation")
        assert hf_dataset_problems(cfg, 256) == []
        assert _tokens([_batches(cfg, 0, 1).micro_batches(0)])[0].startswith(b"document 0: ")


def test_a_hub_name_missing_from_the_cache_offline_is_one_line(tmp_path, monkeypatch):
    offline(monkeypatch, tmp_path / "hf-home")
    problems = hf_dataset_problems(DataConfig(kind="hf", source="acme/absent", tokenizer="bytes"), 256)
    assert len(problems) == 1 and problems[0].startswith("data.source=acme/absent") and "offline" in problems[0]
