"""Token ids never wrap, and data meets only models and datasets of its own tokenizer (a fingerprint in meta.json)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.helpers import write_hf_weights
from trainctl.config.compose import compose
from trainctl.config.data_check import model_tokenizer_problems
from trainctl.config.errors import ConfigError
from trainctl.config.schema import DataConfig
from trainctl.config.validate import resolve
from trainctl.data.format import (
    BYTES_FINGERPRINT,
    DatasetError,
    dtype_for_vocab,
    read_meta,
    tokenizer_fingerprint,
)
from trainctl.data.prepare import prepare
from trainctl.data.shards import SplitWriter

pytest.importorskip("tokenizers")


def word_level(vocab: dict[str, int], eos: str = "</s>") -> dict:
    """A tokenizer.json by hand: a word-level model over `vocab`, whitespace pre-tokenizer, `eos` added."""
    added = [{"id": vocab[eos], "content": eos, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True}]
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
            "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}}


def write_json(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("a b c a b c zzz")
    return path


# ---------------------------------------------------------------- widths


def test_sparse_ids_set_the_width_and_vocabulary_by_the_largest_id(tmp_path, text):
    tok = write_json(tmp_path / "tok.json", word_level({"<unk>": 0, "a": 1, "b": 2, "c": 3, "</s>": 70000}))
    meta = prepare([str(text)], tmp_path / "out", tokenizer=str(tok), val_fraction=0.0, workers=1)
    assert (meta.token_dtype, meta.tokenizer.vocab_size, meta.tokenizer.eos_id) == ("uint32", 70001, 70000)
    tokens = np.fromfile(meta.shard_paths("train")[0], dtype=meta.token_dtype)
    assert tokens.tolist() == [1, 2, 3, 1, 2, 3, 0, 70000]


def test_a_model_folder_stands_for_its_tokenizer_json(tmp_path, text):
    write_json(tmp_path / "llama" / "tokenizer.json", word_level({"<unk>": 0, "a": 1, "</s>": 2}))
    meta = prepare([str(text)], tmp_path / "out", tokenizer=str(tmp_path / "llama"), val_fraction=0.0, workers=1)
    assert (meta.tokenizer.kind, meta.tokenizer.source) == ("hf", str(tmp_path / "llama" / "tokenizer.json"))
    trained = prepare([str(text)], tmp_path / "bpe", train_tokenizer=True, vocab_size=260, workers=1)
    assert (trained.tokenizer.kind, trained.tokenizer.source) == ("bpe", None)


def test_an_id_at_the_edge_of_uint16_keeps_uint16(tmp_path, text):
    tok = write_json(tmp_path / "tok.json", word_level({"<unk>": 0, "a": 1, "</s>": 65535}))
    meta = prepare([str(text)], tmp_path / "out", tokenizer=str(tok), val_fraction=0.0, workers=1)
    assert (meta.token_dtype, meta.tokenizer.vocab_size) == ("uint16", 65536)
    assert np.fromfile(meta.shard_paths("train")[0], dtype="uint16").max() == 65535


def test_ids_no_width_holds_are_refused():
    assert dtype_for_vocab(1 << 32) == "uint32"
    with pytest.raises(DatasetError, match="does not fit the widest token width") as err:
        dtype_for_vocab((1 << 32) + 1)
    assert "\n" not in str(err.value)


def test_every_id_is_checked_against_the_vocabulary_and_width_before_it_is_written(tmp_path):
    writer = SplitWriter(tmp_path, "train", "uint16", limit=100, vocab_size=300)
    writer.append(np.asarray([1, 299], dtype=np.uint32), 1)
    for bad in (300, 65536 + 5):  # past the vocabulary; one that uint16 would wrap to 5
        with pytest.raises(DatasetError, match=f"token id {bad}"):
            writer.append(np.asarray([1, bad], dtype=np.uint32), 1)
    assert np.fromfile(tmp_path / "train-00000.bin", dtype="uint16").tolist() == [1, 299]


def test_vocab_size_too_big_for_any_width_is_refused(tmp_path, text):
    with pytest.raises(DatasetError, match="--vocab-size"):
        prepare([str(text)], tmp_path / "out", train_tokenizer=True, vocab_size=10**12, workers=1)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- fingerprints


def test_the_fingerprint_follows_what_decides_the_ids(tmp_path):
    base = word_level({"<unk>": 0, "a": 1, "b": 2, "</s>": 3})
    fp = tokenizer_fingerprint(write_json(tmp_path / "a.json", base))
    cosmetic = {**base, "decoder": {"type": "WordPiece"}, "post_processor": {"type": "ByteLevel"}, "padding": None}
    reordered = json.loads(json.dumps(base))
    reordered["model"]["vocab"] = dict(reversed(list(base["model"]["vocab"].items())))
    assert tokenizer_fingerprint(write_json(tmp_path / "b.json", cosmetic)) == fp
    assert tokenizer_fingerprint(write_json(tmp_path / "c.json", reordered)) == fp
    swapped = word_level({"<unk>": 0, "a": 2, "b": 1, "</s>": 3})
    normalized = {**base, "normalizer": {"type": "Lowercase"}}
    for i, other in enumerate([swapped, normalized]):
        assert tokenizer_fingerprint(write_json(tmp_path / f"o{i}.json", other)) != fp
    assert fp.startswith("sha256:") and len(fp) == len("sha256:") + 64


def test_a_fingerprint_never_reads_a_fifo(tmp_path):
    import os

    os.mkfifo(tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match="not a regular file"):
        tokenizer_fingerprint(tmp_path / "tokenizer.json")  # a plain read would block forever
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="nested too deeply"):
        tokenizer_fingerprint(tmp_path / "deep.json")


def test_merges_written_by_old_and_new_tokenizers_versions_are_the_same(tmp_path):
    model = {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [["a", "b"]]}
    new = {"model": model, "added_tokens": []}
    old = {"model": {**model, "merges": ["a b"]}, "added_tokens": []}
    assert tokenizer_fingerprint(write_json(tmp_path / "n.json", new)) == \
        tokenizer_fingerprint(write_json(tmp_path / "o.json", old))


def test_meta_json_records_the_fingerprint_and_older_datasets_compute_it(tmp_path, text):
    tok = write_json(tmp_path / "tok.json", word_level({"<unk>": 0, "a": 1, "b": 2, "c": 3, "</s>": 4}))
    meta = prepare([str(text)], tmp_path / "hf", tokenizer=str(tok), val_fraction=0.0, workers=1)
    assert meta.tokenizer.fingerprint == tokenizer_fingerprint(tok)
    raw = json.loads((tmp_path / "hf" / "meta.json").read_text())
    assert raw["tokenizer"]["fingerprint"] == tokenizer_fingerprint(tok)
    del raw["tokenizer"]["fingerprint"]  # as an older trainctl wrote it
    (tmp_path / "hf" / "meta.json").write_text(json.dumps(raw))
    assert read_meta(tmp_path / "hf").tokenizer.fingerprint == tokenizer_fingerprint(tok)
    assert prepare([str(text)], tmp_path / "b", val_fraction=0.0, workers=1).tokenizer.fingerprint == BYTES_FINGERPRINT


# ---------------------------------------------------------------- refused at plan time


@pytest.fixture
def two_tokenizers(tmp_path):
    """Datasets of the same text: bytes, a word-level tokenizer, and that tokenizer with other ids."""
    folder = tmp_path / "text"
    folder.mkdir()
    words = ["alpha", "beta", "gamma", "delta"]
    for i in range(12):
        (folder / f"{i}.txt").write_text(" ".join(words[(i + j) % 4] for j in range(60)))
    vocab = {"<unk>": 0, "</s>": 1, **{w: 2 + k for k, w in enumerate(words)}}
    one = write_json(tmp_path / "one" / "tokenizer.json", word_level(vocab))
    other = write_json(tmp_path / "two" / "tokenizer.json", word_level({**vocab, "alpha": 5, "delta": 2}))
    made = {}
    for name, tok in (("bytes", "bytes"), ("one", str(one)), ("one_again", str(one)), ("other", str(other))):
        prepare([str(folder)], tmp_path / f"d-{name}", tokenizer=tok, val_fraction=0.3, workers=1)
        made[name] = str(tmp_path / f"d-{name}")
    return made, one


def composed(*overrides):
    return resolve(compose(["recipe=tiny_cpu", "data=memmap", "train.seq_len=16", *overrides]))


def test_blending_datasets_of_different_tokenizers_is_refused_in_one_line(two_tokenizers):
    made, _ = two_tokenizers
    composed(f"data.datasets=[{made['one']},{made['one_again']}]")  # one tokenizer: fine
    for a, b in (("one", "other"), ("bytes", "one")):
        with pytest.raises(ConfigError) as err:
            composed(f"data.datasets=[{made[a]},{made[b]}]")
        (line,) = err.value.problems
        assert "another tokenizer" in line and made[b] in line


LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 176, "vocab_size": 300, "max_position_embeddings": 128,
         "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}


def hf_model(folder, tokenizer=None):
    write_json(folder / "config.json", LLAMA)
    write_hf_weights(folder)
    if tokenizer is not None:
        (folder / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    return folder


def test_data_of_another_tokenizer_than_the_models_is_refused(two_tokenizers, tmp_path):
    made, one = two_tokenizers
    model = hf_model(tmp_path / "llama", tokenizer=one)
    assert model_tokenizer_problems(DataConfig(kind="memmap", datasets=[made["one"]]), str(model)) == []
    (line,) = model_tokenizer_problems(DataConfig(kind="memmap", datasets=[made["bytes"]]), str(model))
    assert "byte tokens" in line and f"--tokenizer {model / 'tokenizer.json'}" in line
    (line,) = model_tokenizer_problems(DataConfig(kind="memmap", datasets=[made["other"]]), str(model))
    assert "another tokenizer than the model's" in line
    bare = hf_model(tmp_path / "bare")  # no tokenizer.json: nothing to compare with
    assert model_tokenizer_problems(DataConfig(kind="memmap", datasets=[made["bytes"]]), str(bare)) == []


@pytest.mark.parametrize("key", ["model.path", "checkpoint.init_from"])
def test_plan_refuses_byte_data_into_a_model_with_a_tokenizer(two_tokenizers, tmp_path, key):
    made, one = two_tokenizers
    model = hf_model(tmp_path / "llama", tokenizer=one)
    base = ["model=hf", f"model.path={model}"] if key == "model.path" else [f"checkpoint.init_from={model}"]
    if key == "checkpoint.init_from":  # a model of the folder's shape, named without model=hf
        base += ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=176",
                 "model.vocab_size=300", "model.max_seq_len=128", "model.rope_theta=10000.0"]
    composed(*base, f"data.datasets=[{made['one']}]", "data.vocab_size=0")
    with pytest.raises(ConfigError) as err:
        composed(*base, f"data.datasets=[{made['bytes']}]", "data.vocab_size=0")
    assert any("byte tokens" in p for p in err.value.problems)
