"""`data=hf` with chat or instruction rows: the same ids and loss masks as `data prepare --format chat|instruction`
of the same records, read whole or streamed, resumed mid-way to the identical sequence; each refusal in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.unit.test_data_chat import CHATS, read_split, tokenizer_folder, write_jsonl
from trainctl.config.compose import compose
from trainctl.config.errors import ConfigError
from trainctl.config.hf_data_check import hf_dataset_problems
from trainctl.config.schema import DataConfig
from trainctl.config.validate import resolve
from trainctl.data.chat import RecordOptions
from trainctl.data.format import LOSS
from trainctl.data.prepare import prepare
from trainctl.models.loss_head import IGNORE_INDEX
from trainctl.train.loop.sources import DataError
from trainctl.train.loop.stream import StreamBatches

datasets = pytest.importorskip("datasets")

SEQ = 15  # windows of 16 tokens
# Conversations of different lengths, so documents straddle windows at different places.
CONVERSATIONS = [[*CHATS[i % 2][: 2 + 2 * (i % 2)], {"role": "user", "content": f"and number {i}?"},
                  {"role": "assistant", "content": "yes " * (i % 4 + 1)}] for i in range(12)]
INSTRUCTIONS = [{"q": f"Add {i} and {i}: ", "a": str(2 * i)} for i in range(40)]


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    datasets.disable_progress_bars()


def _batches(cfg: DataConfig, rank: int = 0, world: int = 1) -> StreamBatches:
    return StreamBatches(cfg, "train", SEQ, 2 * world, 2, 1, rank, world, 0)  # 2 windows per step and rank


def _chat(tmp_path: Path) -> tuple[Path, Path]:
    """(the tokenizer folder, with Qwen's template; the conversations as a .jsonl file)."""
    folder = tokenizer_folder(tmp_path, "qwen")
    return folder, write_jsonl(tmp_path / "chat.jsonl", [{"messages": c, "n": i} for i, c in enumerate(CONVERSATIONS)])


def _sources(tmp_path: Path, source: Path) -> dict[str, str]:
    """The .jsonl's rows as a save_to_disk folder (read whole) and the file itself (streamed)."""
    rows = [json.loads(line) for line in source.read_text().splitlines()]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    return {"saved": str(tmp_path / "saved"), "streamed": str(source)}


def _expected(tokens: np.ndarray, flags: np.ndarray, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (inputs, targets) the first `steps` steps must read: prepared windows in order, targets outside the
    answers IGNORE_INDEX (written out here, not through the worker's own helper)."""
    width, out = SEQ + 1, []
    for w in range(2 * steps):
        ids = torch.from_numpy(tokens[w * width:(w + 1) * width].astype(np.int64))
        counted = torch.from_numpy((flags[w * width:(w + 1) * width] & LOSS) != 0)
        out.append((ids[:-1], torch.where(counted[1:], ids[1:], IGNORE_INDEX)))
    return out


def _read(batches: StreamBatches, steps: range) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(inputs[row], targets[row]) for s in steps for inputs, targets in batches.micro_batches(s)
            for row in range(inputs.shape[0])]


def _same(got: list, want: list) -> None:
    assert len(got) == len(want)
    for (gi, gt), (wi, wt) in zip(got, want, strict=True):
        assert torch.equal(gi, wi) and torch.equal(gt, wt)


@pytest.mark.parametrize("which", ["saved", "streamed"])
def test_chat_rows_read_as_the_prepared_chat_dataset_of_the_same_conversations(tmp_path, which):
    folder, source = _chat(tmp_path)
    prepare([str(source)], tmp_path / "out", tokenizer=str(folder), val_fraction=0, workers=1,
            records=RecordOptions("chat"))
    tokens, flags = read_split(tmp_path / "out")
    steps = len(tokens) // (2 * (SEQ + 1))  # the whole split but its last partial step
    assert steps >= 8 and (flags & LOSS).any() and not (flags & LOSS).all()
    cfg = DataConfig(kind="hf", source=_sources(tmp_path, source)[which], streaming=which == "streamed",
                     messages_field="messages", tokenizer=str(folder / "tokenizer.json"), vocab_size=512)
    assert hf_dataset_problems(cfg, 512) == []
    batches = _batches(cfg)
    assert batches.masked
    _same(_read(batches, range(steps)), _expected(tokens, flags, steps))


@pytest.mark.parametrize("which", ["saved", "streamed"])
def test_instruction_rows_read_as_the_prepared_instruction_dataset(tmp_path, which):
    source = write_jsonl(tmp_path / "i.jsonl", INSTRUCTIONS)
    prepare([str(source)], tmp_path / "out", val_fraction=0, workers=1,
            records=RecordOptions("instruction", prompt_field="q", completion_field="a"))
    tokens, flags = read_split(tmp_path / "out")
    steps = len(tokens) // (2 * (SEQ + 1))
    cfg = DataConfig(kind="hf", source=_sources(tmp_path, source)[which], streaming=which == "streamed",
                     prompt_field="q", completion_field="a", tokenizer="bytes", vocab_size=256)
    _same(_read(_batches(cfg), range(steps)), _expected(tokens, flags, steps))


def test_a_streamed_chat_resumed_mid_way_reads_the_identical_sequence(tmp_path):
    folder, source = _chat(tmp_path)
    cfg = DataConfig(kind="hf", source=str(source), streaming=True, messages_field="messages",
                     tokenizer=str(folder / "tokenizer.json"), vocab_size=512)
    for rank in (0, 1):
        straight = _batches(cfg, rank, 2)
        whole = _read(straight, range(30))  # past the end of this rank's rows: a second epoch
        assert straight._stream.epoch >= 1
        stopped = _batches(cfg, rank, 2)
        first = _read(stopped, range(7))
        state = json.loads(json.dumps(stopped.state_dict()))  # what a checkpoint keeps survives a round trip
        assert len(state["flags"]) == len(state["buffer"]) > 0  # stopped inside a document: masks pending
        resumed = _batches(cfg, rank, 2)
        resumed.load_state_dict(state)
        _same(first + _read(resumed, range(7, 30)), whole)


# ---------------------------------------------------------------- refusals


def test_a_chat_field_missing_from_the_dataset_is_one_line_naming_the_key(tmp_path):
    folder, source = _chat(tmp_path)
    cfg = DataConfig(kind="hf", source=_sources(tmp_path, source)["saved"], messages_field="conversation",
                     tokenizer=str(folder / "tokenizer.json"), vocab_size=512)
    problems = hf_dataset_problems(cfg, 512)
    assert len(problems) == 1 and "\n" not in problems[0], problems
    assert problems[0].startswith("data.messages_field=conversation") and "messages" in problems[0]
    with pytest.raises(DataError, match="data.messages_field=conversation"):
        _batches(cfg).micro_batches(0)


@pytest.mark.parametrize("fields, words", [
    (["data.text_field=text", "data.messages_field=messages"], "data.text_field=text and data.messages_field"),
    (["data.messages_field=messages", "data.prompt_field=q", "data.completion_field=a"], "name one kind of row"),
    (["data.prompt_field=q"], "data.prompt_field=q: instruction rows need data.completion_field"),
])
def test_text_and_chat_fields_together_are_refused_at_compose(fields, words):
    with pytest.raises(ConfigError) as err:
        resolve(compose(["data=hf", "data.tokenizer=bytes", "data.source=x", "train.eval_every=0", *fields]))
    assert words in str(err.value) and "\n" not in str(err.value).strip(), str(err.value)


def test_a_tokenizer_without_a_chat_template_is_refused_at_compose(tmp_path):
    folder = tokenizer_folder(tmp_path, "qwen")
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    for tokenizer, words in ((str(folder), "has no chat template"), ("bytes", "data.tokenizer=bytes has no chat")):
        with pytest.raises(ConfigError) as err:
            resolve(compose(["data=hf", f"data.tokenizer={tokenizer}", "data.source=x", "train.eval_every=0",
                             "data.messages_field=messages"]))
        assert "data.messages_field=messages" in str(err.value) and words in str(err.value), str(err.value)
