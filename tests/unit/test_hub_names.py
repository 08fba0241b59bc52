"""Hub names (org/name) where a model folder goes, resolved through a Hugging Face cache built here (no network):
the snapshot the cache's refs/main names, its commit pinned in the run's records, and one line when it is missing
while offline. The tokenizer folder's own tokenizer_config.json decides the end and beginning tokens."""

from __future__ import annotations

import numpy as np
import pytest

from tests.unit.test_data_tokenizers import word_level, write_json
from tests.unit.test_hf_config import LLAMA, hf_folder
from trainctl.config.compose import compose
from trainctl.config.errors import ConfigError
from trainctl.config.validate import resolve
from trainctl.core import hub
from trainctl.data.format import DatasetError, read_meta
from trainctl.data.prepare import prepare
from trainctl.launch.rundir import hub_pins

pytest.importorskip("huggingface_hub")
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cached_model(cache, name: str = "org/tiny", commit: str = COMMIT):
    """A model in the layout huggingface_hub reads: models--org--name/{refs/main, snapshots/<commit>/...}."""
    repo = cache / f"models--{name.replace('/', '--')}"
    snapshot = hf_folder(repo / "snapshots" / commit, LLAMA)
    write_json(snapshot / "tokenizer.json", word_level({"<unk>": 0, "a": 1, "b": 2, "</s>": 3, "<s>": 4}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # a relative folder org/tiny does not exist here
    return tmp_path / "hub"


def test_a_hub_name_in_the_cache_is_its_snapshot_and_the_commit_is_recorded(cache):
    snapshot = cached_model(cache)
    cfg = resolve(compose(["model=hf", "model.path=org/tiny", "checkpoint.init_from=org/tiny", "data=synthetic",
                           "train.seq_len=64"]))
    assert cfg.model.path == cfg.checkpoint.init_from == str(snapshot)
    assert (cfg.model.dim, cfg.model.vocab_size) == (LLAMA["hidden_size"], LLAMA["vocab_size"])
    pin = {"name": "org/tiny", "revision": COMMIT}
    assert hub_pins(cfg) == {"hub": {"model.path": pin, "checkpoint.init_from": pin}}


def test_a_new_commit_on_main_moves_the_name_and_a_folder_is_not_looked_up(cache, tmp_path):
    cached_model(cache)
    repo = cache / "models--org--tiny"
    hf_folder(repo / "snapshots" / ("f" * 40), LLAMA)
    (repo / "refs" / "main").write_text("f" * 40)
    assert hub.pin(hub.resolve("org/tiny")) == {"name": "org/tiny", "revision": "f" * 40}
    local = hf_folder(tmp_path / "org" / "tiny", LLAMA)  # a folder of that relative name wins: no lookup
    assert hub.resolve("org/tiny") == "org/tiny" and local.is_dir()


def test_a_name_missing_offline_is_one_line_saying_how_to_fetch_it(cache):
    with pytest.raises(ConfigError) as err:
        resolve(compose(["model=hf", "model.path=meta-llama/Llama-3.2-1B", "data=synthetic"]))
    (line,) = err.value.problems
    assert line.startswith("model.path=meta-llama/Llama-3.2-1B: not a folder, and not in the Hugging Face cache")
    assert "HF_HUB_OFFLINE" in line and "hf download meta-llama/Llama-3.2-1B" in line
    assert "huggingface-cli download meta-llama/Llama-3.2-1B" in line


def test_paths_and_names_are_told_apart():
    assert hub.is_hub_name("meta-llama/Llama-3.2-1B") and hub.is_hub_name("Qwen/Qwen2.5-0.5B")
    for value in ("/abs/dir", "./rel", "~/x", "a/b/c", "../up", "a/..", "a--b/c", "plain", ""):
        assert not hub.is_hub_name(value), value
    assert hub.pin("/somewhere/else") is None


def test_data_prepare_takes_a_hub_name_for_its_tokenizer(cache, tmp_path):
    snapshot = cached_model(cache)
    (tmp_path / "t.txt").write_text("a b a b")
    meta = prepare([str(tmp_path / "t.txt")], tmp_path / "out", tokenizer="org/tiny", val_fraction=0.0, workers=1)
    assert meta.tokenizer.source == str(snapshot / "tokenizer.json")
    with pytest.raises(DatasetError, match=r"^--tokenizer org/none: not a folder, .*hf download org/none"):
        prepare([str(tmp_path / "t.txt")], tmp_path / "out2", tokenizer="org/none", workers=1)
    assert not (tmp_path / "out2").exists()


# ---------------------------------------------------------------- the tokenizer folder's own special tokens

VOCAB = {"<unk>": 0, "a": 1, "b": 2, "</s>": 3, "<s>": 4, "<|eot|>": 5}


def tokens_of(meta) -> list[int]:
    return np.fromfile(meta.shard_paths("train")[0], dtype=meta.token_dtype).tolist()


@pytest.fixture
def folder(tmp_path):
    tokenizer = word_level(VOCAB)
    tokenizer["added_tokens"] += [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                                   "normalized": False, "special": True} for t, i in (("<s>", 4), ("<|eot|>", 5))]
    write_json(tmp_path / "model" / "tokenizer.json", tokenizer)
    (tmp_path / "t.txt").write_text("a b")
    return tmp_path / "model"


def _prepare(tmp_path, folder, out, **options):
    return prepare([str(tmp_path / "t.txt")], tmp_path / out, tokenizer=str(folder), val_fraction=0.0, workers=1,
                   **options)


def test_tokenizer_config_names_the_end_and_beginning_tokens(tmp_path, folder):
    # Without a config: the built-in list's </s>, no beginning token.
    assert tokens_of(_prepare(tmp_path, folder, "plain")) == [1, 2, 3]
    # The folder's eos_token beats the list; its bos_token (as an AddedToken dict) starts every document.
    write_json(folder / "tokenizer_config.json", {"eos_token": "<|eot|>", "bos_token": {"content": "<s>"}})
    meta = _prepare(tmp_path, folder, "configured")
    assert tokens_of(meta) == [4, 1, 2, 5] and meta.tokenizer.eos_id == 5
    assert tokens_of(_prepare(tmp_path, folder, "no-bos", bos=False)) == [1, 2, 5]
    # add_bos_token false (a Qwen-like config) keeps the bos token out unless --bos asks for it.
    write_json(folder / "tokenizer_config.json", {"eos_token": "</s>", "bos_token": "<s>", "add_bos_token": False})
    assert tokens_of(_prepare(tmp_path, folder, "off")) == [1, 2, 3]
    assert tokens_of(_prepare(tmp_path, folder, "on", bos=True)) == [4, 1, 2, 3]


def test_bos_without_a_beginning_token_is_one_line(tmp_path, folder):
    with pytest.raises(DatasetError, match=r"^--bos: .* has no beginning-of-text token"):
        _prepare(tmp_path, folder, "out", bos=True)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- weights named but not loaded


def test_plan_warns_when_a_folders_weights_are_named_but_not_loaded(cache, tmp_path):
    from trainctl.plan.runplan import build

    cached_model(cache)
    shape_only = hf_folder(tmp_path / "shape", LLAMA, weights=False)
    base = ["model=hf", "data=synthetic", "train.seq_len=64", "cluster.procs_per_node=1", "cluster.device=cpu",
            "precision=fp32"]

    def warned(*overrides):
        return [w for w in build(resolve(compose([*base, *overrides]))).warnings if "not its weights" in w]

    (line,) = warned("model.path=org/tiny")
    assert line == ("model.path=org/tiny: takes the model's shape, not its weights: the run starts from random "
                    "weights; add checkpoint.init_from=org/tiny to train from them")
    assert warned("model.path=org/tiny", "checkpoint.init_from=org/tiny") == []
    assert warned(f"model.path={shape_only}") == []  # a config.json alone names a shape, no weights


def test_bos_where_no_tokenizer_of_the_run_has_one_is_refused_before_anything_is_written(tmp_path):
    (tmp_path / "t.txt").write_text("a b")
    for options, words in (({}, "the bytes"), ({"train_tokenizer": True, "vocab_size": 260}, "a trained")):
        with pytest.raises(DatasetError, match=f"^--bos: {words} tokenizer has no beginning-of-text token"):
            prepare([str(tmp_path / "t.txt")], tmp_path / "out", bos=True, workers=1, **options)
        assert not (tmp_path / "out").exists()


def test_the_cli_takes_bos_for_text_and_refuses_it_for_chat_records(tmp_path, folder, monkeypatch, capsys):
    from tests.helpers import cli_in_process

    write_json(folder / "tokenizer_config.json", {"eos_token": "</s>", "bos_token": "<s>", "add_bos_token": False})
    code, out, _ = cli_in_process(monkeypatch, capsys, "data", "prepare", str(tmp_path / "t.txt"), "--out",
                                  str(tmp_path / "cli"), "--tokenizer", str(folder), "--bos", "--val-fraction", "0")
    assert code == 0, out
    assert tokens_of(read_meta(tmp_path / "cli")) == [4, 1, 2, 3]
    (tmp_path / "c.jsonl").write_text('{"messages": [{"role": "user", "content": "a"}]}\n')
    code, _, err = cli_in_process(monkeypatch, capsys, "data", "prepare", str(tmp_path / "c.jsonl"), "--out",
                                  str(tmp_path / "chat"), "--format", "chat", "--tokenizer", str(folder), "--no-bos")
    assert code == 2 and "--bos/--no-bos: for text documents" in err and not (tmp_path / "chat").exists()
