"""An interrupted `data prepare` resumes to the bytes of an uninterrupted one, whatever happened to its shards."""

from __future__ import annotations

import json

import pytest

from trainctl.data import prepare as prep
from trainctl.data import prepare_job
from trainctl.data.format import DatasetError
from trainctl.data.prepare import prepare

DOCS = [f"document {i}: " + "some words here " * (3 + i % 4) for i in range(8)]
OPTIONS = dict(val_fraction=0.3, shard_tokens=40, workers=1)


@pytest.fixture
def text_dir(tmp_path):
    folder = tmp_path / "text"
    folder.mkdir()
    for i, doc in enumerate(DOCS):
        (folder / f"doc{i}.txt").write_text(doc)
    return folder


def stop_after(units: int):
    calls = []

    def progress(done, total):
        calls.append(done)
        if len(calls) == units + 1:  # the first call reports the start
            raise KeyboardInterrupt

    return progress


def interrupted(text_dir, out, units: int, **options):
    with pytest.raises(KeyboardInterrupt):
        prepare([str(text_dir)], out, progress=stop_after(units), **{**OPTIONS, **options})
    assert (out / prep.STATE_FILE).is_file() and not (out / "meta.json").exists()


def files_of(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != "meta.json"}


def meta_of(folder) -> dict:
    meta = json.loads((folder / "meta.json").read_text())
    meta.pop("created")
    return meta


def damage(out, how: str) -> None:
    shards = sorted(out.glob("train-*.bin"))
    assert len(shards) >= 2, "the interrupted run should have written several shards"
    first, last = shards[0], shards[-1]
    if how == "truncate":
        last.write_bytes(last.read_bytes()[:-7])  # more than the zero bytes of an EOS and a high byte
    elif how == "truncate-first":
        first.write_bytes(first.read_bytes()[:10])
    elif how == "delete":
        first.unlink()
    elif how == "flip":
        data = bytearray(first.read_bytes())
        data[len(data) // 2] ^= 0x01
        first.write_bytes(bytes(data))
    elif how == "extend":
        first.write_bytes(first.read_bytes() + b"\x01\x02")
    elif how == "extend-last":
        last.write_bytes(last.read_bytes() + b"\x01\x02\x03")
    elif how == "stray":
        (out / "train-00042.bin").write_bytes(b"\x07\x00" * 5)


@pytest.mark.parametrize("how", ["truncate", "truncate-first", "delete", "flip", "extend", "extend-last", "stray"])
def test_a_damaged_shard_is_redone_and_the_result_is_byte_identical(text_dir, tmp_path, how):
    clean = tmp_path / "clean"
    prepare([str(text_dir)], clean, **OPTIONS)
    out = tmp_path / "out"
    interrupted(text_dir, out, units=5)
    damage(out, how)
    prepare([str(text_dir)], out, **OPTIONS)
    assert files_of(out) == files_of(clean)
    assert meta_of(out) == meta_of(clean)


@pytest.mark.parametrize("tail", [b'{"train": [3, 1', b"\x00garbage\n", b'{"train": "x"}\n'])
def test_a_torn_last_line_of_the_record_ends_it_there(text_dir, tmp_path, tail):
    clean = tmp_path / "clean"
    prepare([str(text_dir)], clean, **OPTIONS)
    out = tmp_path / "out"
    interrupted(text_dir, out, units=4)
    with (out / prep.STATE_FILE).open("ab") as f:
        f.write(tail)
    prepare([str(text_dir)], out, **OPTIONS)
    assert files_of(out) == files_of(clean) and meta_of(out) == meta_of(clean)


def test_the_record_grows_by_one_line_per_unit(text_dir, tmp_path):
    out = tmp_path / "out"
    interrupted(text_dir, out, units=5)
    header, *units = (out / prep.STATE_FILE).read_text().splitlines()
    assert "fingerprint" in json.loads(header) and len(units) == 5
    assert all(set(json.loads(u)) == {"train", "val", "pieces"} for u in units)


def test_a_resume_redoes_only_what_does_not_read_back(text_dir, tmp_path, monkeypatch):
    out = tmp_path / "out"
    interrupted(text_dir, out, units=5)
    shards = sorted(out.glob("train-*.bin"))
    shards[-1].write_bytes(shards[-1].read_bytes()[:-2])  # the end of the newest shard: the last units only
    done = []
    real = prepare_job.tokenize_unit
    monkeypatch.setattr(prepare_job, "tokenize_unit",
                        lambda unit, *a, **k: done.append(unit.path.name) or real(unit, *a, **k))
    prepare([str(text_dir)], out, **OPTIONS)
    assert 0 < len(done) - (len(DOCS) - 5) < 5  # some of the five done before, not all of them


@pytest.mark.parametrize("how", ["delete", "truncate"])
def test_a_lost_or_damaged_trained_tokenizer_redoes_everything(text_dir, tmp_path, how):
    pytest.importorskip("tokenizers")
    options = dict(train_tokenizer=True, vocab_size=280)
    clean = tmp_path / "clean"
    prepare([str(text_dir)], clean, **OPTIONS, **options)
    out = tmp_path / "out"
    interrupted(text_dir, out, units=4, **options)
    trained = out / "tokenizer.json"
    if how == "delete":
        trained.unlink()
    else:
        trained.write_bytes(trained.read_bytes()[:100])
    prepare([str(text_dir)], out, **OPTIONS, **options)
    assert files_of(out) == files_of(clean) and meta_of(out) == meta_of(clean)


def test_a_resume_with_a_changed_tokenizer_file_is_refused(text_dir, tmp_path):
    from tests.unit.test_data_prepare import hf_tokenizer_file

    _, path = hf_tokenizer_file(tmp_path, DOCS)
    out = tmp_path / "out"
    interrupted(text_dir, out, units=3, tokenizer=str(path), val_fraction=0.0)
    path.write_text(path.read_text().replace('"document"', '"documents"'))  # same path, other ids
    with pytest.raises(DatasetError, match="other inputs or options"):
        prepare([str(text_dir)], out, **{**OPTIONS, "val_fraction": 0.0}, tokenizer=str(path))


def test_a_damaged_state_file_is_one_line_and_the_folder_is_kept(text_dir, tmp_path):
    out = tmp_path / "out"
    interrupted(text_dir, out, units=3)
    (out / prep.STATE_FILE).write_text("{")
    with pytest.raises(DatasetError) as err:
        prepare([str(text_dir)], out, **OPTIONS)
    assert "damaged; delete" in str(err.value) and "\n" not in str(err.value)
    assert any(out.glob("train-*.bin"))


def test_a_prepare_killed_while_training_its_tokenizer_is_finished_by_the_same_command(text_dir, tmp_path,
                                                                                       monkeypatch):
    pytest.importorskip("tokenizers")
    options = dict(train_tokenizer=True, vocab_size=280)
    clean = tmp_path / "clean"
    prepare([str(text_dir)], clean, **OPTIONS, **options)
    out = tmp_path / "out"

    def dies_half_way(texts, vocab_size, out_file):
        out_file.with_name(f".{out_file.name}.tmp-12345").write_text("{half a tokenizer")
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(prepare_job, "train_bpe", dies_half_way)
        with pytest.raises(KeyboardInterrupt):
            prepare([str(text_dir)], out, **OPTIONS, **options)
    prepare([str(text_dir)], out, **OPTIONS, **options)
    assert files_of(out) == files_of(clean) and meta_of(out) == meta_of(clean)
