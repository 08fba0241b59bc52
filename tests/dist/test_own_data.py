"""A user's own text end to end: `data prepare` (a BPE trained on it), a launch that trains on it, an export
that transformers loads with its tokenizer; bad data refused by `plan` in one line, nothing written."""

from __future__ import annotations

import json
import random
import shutil
from functools import partial
from pathlib import Path

import pytest

from tests.helpers import run_cli

pytestmark = [pytest.mark.dist, pytest.mark.slow]
WORDS = ["river", "stone", "light", "garden", "window", "paper", "signal", "orange", "market", "silver"]


# Training through the CLI: longer than run_cli's default limit.
trainctl = partial(run_cli, timeout=600)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    (root / "notes").mkdir()
    for i in range(12):
        sentences = [" ".join(rng.choice(WORDS) for _ in range(12)) + "." for _ in range(60)]
        (root / "notes" / f"{i:02d}.txt").write_text("\n".join(sentences))
    with (root / "more.jsonl").open("w") as f:
        for _ in range(50):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(40))}) + "\n")
    return root


def word_tokenizer(folder: Path) -> Path:
    """A Hugging Face tokenizer.json (word level over WORDS, with `</s>`), as a user would bring one."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS) + " ."], tokenizers.trainers.WordLevelTrainer(
        special_tokens=["<unk>", "</s>"]))
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


@pytest.mark.parametrize("kind", ["bytes", "hf", "bpe"])
def test_each_tokenizer_kind_prepares_and_trains(corpus, tmp_path, kind):
    options = {"bytes": [], "hf": ["--tokenizer", str(word_tokenizer(tmp_path))],
               "bpe": ["--train-tokenizer", "--vocab-size", "320"]}[kind]
    prepared = trainctl("data", "prepare", str(corpus / "notes"), str(corpus / "*.jsonl"), "--out", "tokens",
                        "--val-fraction", "0.1", *options, cwd=tmp_path)
    assert prepared.returncode == 0, prepared.stderr
    meta = json.loads((tmp_path / "tokens" / "meta.json").read_text())
    assert meta["tokenizer"]["kind"] == kind and meta["splits"]["val"]["documents"] > 0
    launch = trainctl("launch", "recipe=tiny_cpu", "model.vocab_size=320", "data=memmap",
                      f"data.datasets=[{tmp_path / 'tokens'}]", "train.steps=6", "train.eval_every=3",
                      "train.eval_batches=2", "schedule.warmup_steps=1", "logging.progress=false", "--name", "own",
                      cwd=tmp_path)
    assert launch.returncode == 0, launch.stdout[-3000:] + launch.stderr[-3000:]
    result = json.loads((tmp_path / "runs" / "own" / "result.json").read_text())
    assert result["final_val_loss"] < result["initial_val_loss"]
    if kind == "bpe":
        exported_with_tokenizer(tmp_path)


def exported_with_tokenizer(tmp_path: Path) -> None:
    """The run's export loads in transformers with the tokenizer its data was prepared with, and generates."""
    transformers = pytest.importorskip("transformers")
    exported = trainctl("export", str(tmp_path / "runs" / "own"), "--out", "hf", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert tokenizer.eos_token == "<|endoftext|>"
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == tokenizer.eos_token_id
    prompt = tokenizer("river stone", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert tokenizer.decode(out[0]).startswith("river stone")


@pytest.fixture(scope="module")
def notes_tokens(corpus, tmp_path_factory) -> Path:
    """The notes prepared once for the cases below that need a dataset (each takes its own copy)."""
    root = tmp_path_factory.mktemp("notes-tokens")
    made = trainctl("data", "prepare", str(corpus / "notes"), "--out", "tok", cwd=root)
    assert made.returncode == 0, made.stderr
    return root / "tok"


@pytest.mark.parametrize("case", ["missing", "unfinished", "vocabulary"])
def test_bad_data_is_refused_by_plan_in_one_line(request, tmp_path, case):
    if case == "missing":
        overrides = [f"data.datasets=[{tmp_path / 'nowhere'}]"]
    else:
        shutil.copytree(request.getfixturevalue("notes_tokens"), tmp_path / "tok")
        if case == "unfinished":
            (tmp_path / "tok" / "meta.json").unlink()
        overrides = [f"data.datasets=[{tmp_path / 'tok'}]"] + (["model.vocab_size=200"] if case == "vocabulary" else [])
    for command in ("plan", "launch"):
        proc = trainctl(command, "recipe=tiny_cpu", "data=memmap", *overrides, cwd=tmp_path)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: data.datasets"), lines
        assert not (tmp_path / "runs").exists()


def test_a_dataset_without_a_val_split_trains_with_evaluation_off(corpus, tmp_path):
    # --val-fraction 0 leaves the val split empty: with evaluation on the plan refuses it (one line, the fix named);
    # with train.eval_every=0 the run trains without evaluating, never dying in the worker.
    made = trainctl("data", "prepare", str(corpus / "notes"), "--out", "tok", "--val-fraction", "0", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    common = ["recipe=tiny_cpu", "data=memmap", f"data.datasets=[{tmp_path / 'tok'}]", "train.steps=4",
              "schedule.warmup_steps=1", "logging.progress=false"]
    refused = trainctl("plan", *common, "train.eval_every=2", cwd=tmp_path)
    assert refused.returncode == 2 and "train.eval_every=0" in refused.stderr, refused.stderr
    launch = trainctl("launch", *common, "train.eval_every=0", "--name", "noval", cwd=tmp_path)
    assert launch.returncode == 0, launch.stdout[-3000:] + launch.stderr[-3000:]
    result = json.loads((tmp_path / "runs" / "noval" / "result.json").read_text())
    assert result["steps"] == 4 and result["final_val_loss"] is None and result["final_train_loss"] > 0
