"""`trainctl data prepare`: text in every supported form, three tokenizers, shards, resume, refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trainctl.data import prepare as prep
from trainctl.data.format import DatasetError, dataset_problems, dtype_for_vocab, read_meta
from trainctl.data.prepare import prepare

DOCS = ["the first document\nwith two lines", "a second, shorter one", "third: ünïcödé text", "fourth doc",
        "fifth and last"]


def tokens_of(meta, split: str) -> np.ndarray:
    parts = [np.fromfile(p, dtype=meta.token_dtype) for p in meta.shard_paths(split)]
    return np.concatenate(parts) if parts else np.zeros(0, meta.token_dtype)


def byte_documents(meta, split: str) -> list[str]:
    raw = bytes(tokens_of(meta, split).astype(np.uint8))
    assert raw.endswith(b"\0") or not raw
    return [d.decode() for d in raw.split(b"\0")[:-1]]


@pytest.fixture
def text_dir(tmp_path):
    folder = tmp_path / "text"
    folder.mkdir()
    for i, doc in enumerate(DOCS):
        (folder / f"doc{i}.txt").write_text(doc)
    return folder


def test_bytes_documents_end_with_eos_and_split_by_document(text_dir, tmp_path):
    meta = prepare([str(text_dir)], tmp_path / "out", val_fraction=0.3, workers=1)
    train, val = byte_documents(meta, "train"), byte_documents(meta, "val")
    assert sorted(train + val) == sorted(DOCS) and val and train
    assert meta.splits["train"].documents == len(train) and meta.splits["val"].documents == len(val)
    assert meta.tokenizer.kind == "bytes" and meta.tokenizer.eos_id == 0 and meta.token_dtype == "uint16"
    assert len(meta.sources) == len(DOCS) and all(len(s["sha256"]) == 64 for s in meta.sources)
    assert not (tmp_path / "out" / prep.STATE_FILE).exists()


def test_jsonl_parquet_and_globs(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(DOCS[:3])))
    pq.write_table(pa.table({"body": DOCS[3:]}), tmp_path / "b.parquet")
    meta = prepare([str(tmp_path / "*.jsonl"), str(tmp_path / "b.parquet")], tmp_path / "out", text_field="body",
                   val_fraction=0.0, workers=1)
    assert byte_documents(meta, "train") == DOCS  # input order: a.jsonl then b.parquet
    assert meta.splits["val"].tokens == 0


def hf_tokenizer_file(tmp_path, texts: list[str]):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"])
    tok.train_from_iterator(texts, trainer=trainer)
    path = tmp_path / "tok" / "tokenizer.json"
    path.parent.mkdir()
    tok.save(str(path))
    return tok, path


def test_a_hugging_face_tokenizer_json(text_dir, tmp_path):
    tok, path = hf_tokenizer_file(tmp_path, DOCS)
    meta = prepare([str(text_dir)], tmp_path / "out", tokenizer=str(path), val_fraction=0.0, workers=1)
    eos = tok.token_to_id("</s>")
    expected = np.concatenate([np.asarray([*tok.encode(d, add_special_tokens=False).ids, eos]) for d in DOCS])
    assert np.array_equal(tokens_of(meta, "train"), expected)
    assert (meta.tokenizer.kind, meta.tokenizer.eos_id, meta.tokenizer.file) == ("hf", eos, "tokenizer.json")
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == path.read_bytes()


def test_training_a_bpe_tokenizer(text_dir, tmp_path):
    pytest.importorskip("tokenizers")
    meta = prepare([str(text_dir)], tmp_path / "out", train_tokenizer=True, vocab_size=300, val_fraction=0.0,
                   workers=1)
    assert meta.tokenizer.kind == "bpe" and 256 < meta.tokenizer.vocab_size <= 300
    assert (tmp_path / "out" / "tokenizer.json").is_file() and meta.token_dtype == "uint16"
    from tokenizers import Tokenizer

    decoded = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json")).decode(
        [int(t) for t in tokens_of(meta, "train")], skip_special_tokens=False)
    assert decoded == "<|endoftext|>".join(DOCS) + "<|endoftext|>"


def test_small_shards_hold_every_token_in_order(text_dir, tmp_path):
    whole = prepare([str(text_dir)], tmp_path / "one", val_fraction=0.0, workers=1)
    sharded = prepare([str(text_dir)], tmp_path / "many", val_fraction=0.0, shard_tokens=20, workers=1)
    shards = sharded.splits["train"].shards
    assert len(shards) > 3 and all(s.tokens <= 20 for s in shards)
    assert sum(s.tokens for s in shards) == whole.splits["train"].tokens
    assert sum(s.documents for s in shards) == len(DOCS)
    assert np.array_equal(tokens_of(sharded, "train"), tokens_of(whole, "train"))


@pytest.mark.cli  # worker processes
def test_the_output_does_not_depend_on_the_number_of_workers(text_dir, tmp_path):
    one = prepare([str(text_dir)], tmp_path / "one", val_fraction=0.4, shard_tokens=30, workers=1)
    two = prepare([str(text_dir)], tmp_path / "two", val_fraction=0.4, shard_tokens=30, workers=2)
    for split in ("train", "val"):
        assert [p.read_bytes() for p in one.shard_paths(split)] == [p.read_bytes() for p in two.shard_paths(split)]


def test_an_interrupted_run_resumes_to_the_same_bytes(text_dir, tmp_path, monkeypatch):
    reference = prepare([str(text_dir)], tmp_path / "ref", val_fraction=0.4, shard_tokens=25, workers=1)
    calls = []

    def stop_after_two(done, total):
        calls.append(done)
        if len(calls) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare([str(text_dir)], tmp_path / "out", val_fraction=0.4, shard_tokens=25, workers=1,
                progress=stop_after_two)
    assert (tmp_path / "out" / prep.STATE_FILE).is_file() and not (tmp_path / "out" / "meta.json").exists()
    # A write that died half-way: bytes past the recorded end are cut back on resume.
    shard = sorted((tmp_path / "out").glob("train-*.bin"))[-1]
    shard.write_bytes(shard.read_bytes() + b"\x01\x02\x03")
    with pytest.raises(DatasetError) as err:  # other arguments: refused, nothing touched
        prepare([str(text_dir)], tmp_path / "out", val_fraction=0.1, workers=1)
    assert "other inputs or options" in str(err.value)
    resumed = prepare([str(text_dir)], tmp_path / "out", val_fraction=0.4, shard_tokens=25, workers=1)
    for split in ("train", "val"):
        assert [p.read_bytes() for p in resumed.shard_paths(split)] == \
            [p.read_bytes() for p in reference.shard_paths(split)]
    assert resumed.splits == reference.splits


def test_a_prepared_dataset_or_a_foreign_folder_is_never_overwritten(text_dir, tmp_path):
    prepare([str(text_dir)], tmp_path / "out", workers=1)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "out").iterdir())
    with pytest.raises(DatasetError, match="already a prepared dataset"):
        prepare([str(text_dir)], tmp_path / "out", workers=1)
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "out").iterdir()) == before
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(DatasetError, match="non-empty folder"):
        prepare([str(text_dir)], tmp_path / "mine", workers=1)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize(("setup", "words"), [
    (lambda d: [str(d / "missing.txt")], "no such file"),
    (lambda d: [str(d / "*.nothing")], "matches no input"),
    (lambda d: [str(_write(d / "empty.txt", ""))], "no text to train on"),
    (lambda d: [str(_write(d / "x.jsonl", '{"body": "x"}\n'))], "no text field 'text'"),
    (lambda d: [str(_write(d / "y.jsonl", "not json\n"))], "not a JSON object"),
])
def test_bad_inputs_are_one_line(tmp_path, setup, words):
    with pytest.raises(DatasetError) as err:
        prepare(setup(tmp_path), tmp_path / "out", workers=1)
    assert words in str(err.value) and "\n" not in str(err.value)


def _write(path, text):
    path.write_text(text)
    return path


def test_train_tokenizer_needs_a_vocab_size(text_dir, tmp_path):
    with pytest.raises(DatasetError, match="--vocab-size"):
        prepare([str(text_dir)], tmp_path / "out", train_tokenizer=True)


# ---------------------------------------------------------------- the format, read without numpy


def test_dataset_problems_name_each_damage(text_dir, tmp_path):
    meta = prepare([str(text_dir)], tmp_path / "out", val_fraction=0.0, shard_tokens=30, workers=1)
    root = tmp_path / "out"
    assert dataset_problems(root, "train", vocab_size=256, seq_len=8) == []
    assert "exceeds model.vocab_size 100" in dataset_problems(root, "train", vocab_size=100, seq_len=8)[0]
    assert "fewer than train.seq_len+1" in dataset_problems(root, "train", vocab_size=256, seq_len=10_000)[0]
    shards = meta.shard_paths("train")
    shards[0].write_bytes(shards[0].read_bytes()[:-1])
    shards[1].unlink()
    problems = dataset_problems(root, "train", vocab_size=256, seq_len=8)
    assert len(problems) == 2 and "bytes, meta.json says" in problems[0] and "is missing" in problems[1]


@pytest.mark.parametrize(("content", "words"), [
    (None, "not a prepared dataset"), ("{", "unreadable"), ('{"format": "other", "version": 1}', "not a trainctl"),
])
def test_read_meta_refuses_what_is_not_a_dataset_in_one_line(tmp_path, content, words):
    (tmp_path / "d").mkdir()
    if content is not None:
        (tmp_path / "d" / "meta.json").write_text(content)
    with pytest.raises(DatasetError) as err:
        read_meta(tmp_path / "d")
    assert words in str(err.value) and "\n" not in str(err.value)


def test_token_width_follows_the_vocabulary():
    assert (dtype_for_vocab(256), dtype_for_vocab(65536), dtype_for_vocab(65537)) == ("uint16", "uint16", "uint32")


def test_a_second_prepare_into_the_same_folder_is_refused_while_the_first_writes(text_dir, tmp_path):
    import fcntl

    out = tmp_path / "out"
    out.mkdir()
    with (out / prep.LOCK_FILE).open("a") as held:  # what a running `data prepare` holds
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(DatasetError, match="another `trainctl data prepare` is writing it"):
            prepare([str(text_dir)], out, workers=1)
        assert sorted(p.name for p in out.iterdir()) == [prep.LOCK_FILE]  # nothing of the second one
    meta = prepare([str(text_dir)], out, workers=1)  # once it is gone, the folder is free
    assert meta.splits["train"].documents + meta.splits["val"].documents == len(DOCS)
    assert not (out / prep.LOCK_FILE).exists()


@pytest.mark.cli  # worker processes
def test_one_big_jsonl_is_cut_into_pieces_that_workers_share(tmp_path):
    from trainctl.data.inputs import plan_units

    lines = [json.dumps({"text": f"record {i}: " + "words and more words " * (i % 7 + 1)}) for i in range(400)]
    big = tmp_path / "big.jsonl"
    big.write_text("\n".join(lines) + "\n")
    units = plan_units([big], unit_bytes=4096)
    assert len(units) > 10 and units[0].start == 0 and units[-1].end == big.stat().st_size
    assert all(a.end == b.start for a, b in zip(units, units[1:], strict=False))
    whole = prepare([str(big)], tmp_path / "whole", val_fraction=0.2, workers=1)
    pieces = prepare([str(big)], tmp_path / "pieces", val_fraction=0.2, workers=2, unit_bytes=4096)
    for split in ("train", "val"):
        assert np.array_equal(tokens_of(pieces, split), tokens_of(whole, split))
    assert pieces.splits["train"].documents + pieces.splits["val"].documents == 400


def test_a_prepare_that_finds_no_text_leaves_nothing(tmp_path):
    (tmp_path / "blank.txt").write_text("   \n")
    with pytest.raises(DatasetError, match="no text to train on"):
        prepare([str(tmp_path / "blank.txt")], tmp_path / "out", workers=1)
    assert not (tmp_path / "out").exists()
