"""Token data: the stdlib corpus cache, user token files, synthetic tokens, and batch determinism."""

from __future__ import annotations

import json
import threading
from dataclasses import replace

import numpy as np
import pytest
import torch

from trainctl.config.schema import DataConfig
from trainctl.train.loop import data_setup
from trainctl.train.loop.data import TokenBatches
from trainctl.train.loop.data_setup import check_vocab, prepare_data
from trainctl.train.loop.sources import DataError

SEQ = 16


@pytest.fixture(scope="session")
def stdlib_cfg(tmp_path_factory) -> DataConfig:
    """The real stdlib corpus, tokenized once per test session (about half a second)."""
    cfg = DataConfig(cache_dir=str(tmp_path_factory.mktemp("cache")))
    prepare_data(cfg)
    return cfg


@pytest.fixture
def arange_cfg(tmp_path) -> DataConfig:
    """Memmap files whose token at offset i is i: a sample's first input is its start offset."""
    train, val = tmp_path / "train.bin", tmp_path / "val.bin"
    np.arange(5000, dtype=np.uint16).tofile(train)
    np.arange(3000, dtype=np.uint16).tofile(val)
    return DataConfig(kind="memmap", train_path=str(train), val_path=str(val), vocab_size=5000)


@pytest.fixture
def fake_stdlib(tmp_path, monkeypatch):
    """A small stand-in stdlib tree (with site-packages to exclude and an empty file to skip)."""
    root = tmp_path / "lib"
    for i in range(40):
        (root / f"pkg{i % 4}").mkdir(parents=True, exist_ok=True)
        (root / f"pkg{i % 4}" / f"mod{i}.py").write_text(f"x = {i}\n" * 50)
    (root / "empty.py").write_text("")
    (root / "site-packages" / "thirdparty").mkdir(parents=True)
    (root / "site-packages" / "thirdparty" / "bad.py").write_text("third party\n")
    (root / "notes.txt").write_text("not python\n")
    monkeypatch.setattr(data_setup, "stdlib_root", lambda: root)
    return root


def batches(cfg, *, split="train", dp_rank=0, dp_size=1, micro_batch=4, grad_accum=1, seed=0, seq_len=SEQ):
    global_batch = micro_batch * grad_accum * dp_size
    return TokenBatches(cfg, split, seq_len, global_batch, micro_batch, grad_accum, dp_rank, dp_size, seed)


def rows(pairs) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack a list of (inputs, targets) micro-batches into one [samples, seq_len] pair, in order."""
    return torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs])


def union_over_ranks(cfg, step, dp_size, grad_accum, micro_batch):
    """The global batch of `step` reassembled in sample order j from every rank's micro-batches."""
    parts = []
    for r in range(dp_size):
        rank = batches(cfg, dp_rank=r, dp_size=dp_size, grad_accum=grad_accum, micro_batch=micro_batch)
        parts += rank.micro_batches(step)
    return rows(parts)


# ---------------------------------------------------------------- stdlib corpus


def test_stdlib_split_is_by_file_disjoint_and_deterministic(stdlib_cfg):
    rel_paths = data_setup.list_stdlib_sources(data_setup.stdlib_root())
    val = {p for p in rel_paths if data_setup.is_val_file(p, stdlib_cfg.val_fraction)}
    train = set(rel_paths) - val
    assert val == {p for p in rel_paths if data_setup.is_val_file(p, stdlib_cfg.val_fraction)}
    assert train and val and not train & val
    assert 0.01 < len(val) / len(rel_paths) < 0.15
    assert not any("site-packages" in p or "dist-packages" in p for p in rel_paths)
    meta = json.loads((data_setup.stdlib_cache_dir(stdlib_cfg) / "meta.json").read_text())
    assert meta["files"] == {"train": len(train), "val": len(val)}


def test_split_is_stable_across_processes_and_machines():
    # Pinned values: a salted hash() or a path-order-dependent split would move files between runs.
    paths = [f"pkg/mod{i}.py" for i in range(20)]
    held_out = [p for p in paths if data_setup.is_val_file(p, 0.3)]
    assert held_out == [f"pkg/mod{i}.py" for i in (0, 3, 5, 6, 11, 12, 14, 17)]


def test_stdlib_tokens_are_bytes_with_one_separator_per_file(stdlib_cfg):
    cache = data_setup.stdlib_cache_dir(stdlib_cfg)
    meta = json.loads((cache / "meta.json").read_text())
    for split in ("train", "val"):
        tokens = np.memmap(cache / f"{split}.bin", dtype=np.uint16, mode="r")
        assert tokens.size == meta["tokens"][split] > 0
        assert int(tokens.max()) < 256
        assert int((tokens == data_setup.SEPARATOR).sum()) == meta["files"][split]
        assert tokens[-1] == data_setup.SEPARATOR


def test_stdlib_cache_is_reused_not_rewritten(stdlib_cfg):
    cache = data_setup.stdlib_cache_dir(stdlib_cfg)
    names = ("train.bin", "val.bin", "meta.json")
    before = {n: (cache / n).stat().st_mtime_ns for n in names}
    prepare_data(stdlib_cfg)
    assert {n: (cache / n).stat().st_mtime_ns for n in names} == before
    assert sorted(p.name for p in cache.iterdir()) == sorted(names)  # no temp files left behind


def test_stdlib_cache_key_depends_on_val_fraction(stdlib_cfg):
    assert data_setup.stdlib_cache_dir(stdlib_cfg) != data_setup.stdlib_cache_dir(replace(stdlib_cfg, val_fraction=0.1))
    assert data_setup.stdlib_cache_dir(stdlib_cfg).name.startswith("stdlib-py")


def test_fake_stdlib_excludes_site_packages_and_empty_files(fake_stdlib, tmp_path):
    rel_paths = data_setup.list_stdlib_sources(fake_stdlib)
    assert len(rel_paths) == 40 and rel_paths == sorted(rel_paths)
    assert "empty.py" not in rel_paths and not any("site-packages" in p for p in rel_paths)
    cfg = DataConfig(cache_dir=str(tmp_path / "cache"), val_fraction=0.3)
    prepare_data(cfg)
    meta = json.loads((data_setup.stdlib_cache_dir(cfg) / "meta.json").read_text())
    assert meta["files"]["train"] + meta["files"]["val"] == 40
    corpus_tokens = sum((fake_stdlib / p).stat().st_size + 1 for p in rel_paths)
    assert meta["tokens"]["train"] + meta["tokens"]["val"] == corpus_tokens


def test_truncated_cache_is_rebuilt(fake_stdlib, tmp_path):
    cfg = DataConfig(cache_dir=str(tmp_path / "cache"), val_fraction=0.3)
    prepare_data(cfg)
    train_bin = data_setup.stdlib_cache_dir(cfg) / "train.bin"
    good = train_bin.read_bytes()
    train_bin.write_bytes(good[:100])
    with pytest.raises(DataError, match="prepare_data"):
        batches(cfg)
    prepare_data(cfg)
    assert train_bin.read_bytes() == good


def test_concurrent_prepare_gives_one_complete_cache(fake_stdlib, tmp_path):
    cfg = DataConfig(cache_dir=str(tmp_path / "cache"), val_fraction=0.3)
    errors = []

    def run():
        try:
            prepare_data(cfg)
        except Exception as e:  # noqa: BLE001 - surfaced by the assert below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    cache = data_setup.stdlib_cache_dir(cfg)
    assert sorted(p.name for p in cache.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    assert data_setup._stdlib_cache_is_complete(cache, data_setup._read_meta(cache))


def test_stdlib_batches_before_prepare_fail_clearly(tmp_path):
    with pytest.raises(DataError, match="data.cache_dir"):
        batches(DataConfig(cache_dir=str(tmp_path / "nothing")))


# ---------------------------------------------------------------- sampling


@pytest.mark.parametrize("source", ["stdlib", "memmap", "synthetic"])
def test_same_seed_and_step_give_identical_batches_different_steps_differ(source, stdlib_cfg, arange_cfg):
    synthetic = DataConfig(kind="synthetic", vocab_size=1000)
    cfg = {"stdlib": stdlib_cfg, "memmap": arange_cfg, "synthetic": synthetic}[source]
    first = rows(batches(cfg, seed=3, grad_accum=2).micro_batches(7))
    again = rows(batches(cfg, seed=3, grad_accum=2).micro_batches(7))  # a fresh object, as after a resume
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[0], rows(batches(cfg, seed=3, grad_accum=2).micro_batches(8))[0])
    assert not torch.equal(first[0], rows(batches(cfg, seed=4, grad_accum=2).micro_batches(7))[0])


@pytest.mark.parametrize("source", ["stdlib", "memmap", "synthetic"])
def test_union_over_dp_and_accum_equals_single_process_batch(source, stdlib_cfg, arange_cfg):
    synthetic = DataConfig(kind="synthetic", vocab_size=1000)
    cfg = {"stdlib": stdlib_cfg, "memmap": arange_cfg, "synthetic": synthetic}[source]
    single = union_over_ranks(cfg, step=5, dp_size=1, grad_accum=1, micro_batch=4)
    split = union_over_ranks(cfg, step=5, dp_size=2, grad_accum=2, micro_batch=1)
    assert single[0].shape == (4, SEQ)
    assert torch.equal(single[0], split[0]) and torch.equal(single[1], split[1])


def test_starts_follow_the_documented_generator(arange_cfg):
    # Step 4 of a global batch of 8 holds stream samples 32..39: draws 32..39 of block 0.
    seed, step = 11, 4
    expected = np.random.default_rng([seed, 0]).integers(0, 5000 - SEQ, size=1024)[32:40]
    parts = []
    for r in range(2):
        parts += batches(arange_cfg, dp_rank=r, dp_size=2, grad_accum=2, micro_batch=2, seed=seed).micro_batches(step)
    inputs, _ = rows(parts)
    assert inputs[:, 0].tolist() == expected.tolist()


def test_dp_ranks_get_disjoint_samples(arange_cfg):
    first_rows = [rows(batches(arange_cfg, dp_rank=r, dp_size=2, micro_batch=4).micro_batches(2))[0] for r in range(2)]
    starts = [set(first[:, 0].tolist()) for first in first_rows]
    assert len(starts[0]) == len(starts[1]) == 4 and not starts[0] & starts[1]


def test_targets_are_inputs_shifted_by_one(arange_cfg, stdlib_cfg):
    x, y = batches(arange_cfg).micro_batches(0)[0]
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (4, SEQ)
    assert torch.equal(y, x + 1)  # arange data: the next token is the next offset
    x, y = batches(stdlib_cfg).micro_batches(0)[0]
    assert torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) < 256


def test_micro_batches_count_and_shape(stdlib_cfg):
    pairs = batches(stdlib_cfg, dp_size=2, dp_rank=1, grad_accum=3, micro_batch=2).micro_batches(1)
    assert len(pairs) == 3 and all(x.shape == y.shape == (2, SEQ) for x, y in pairs)


def test_global_batch_must_match_the_split():
    with pytest.raises(AssertionError):
        TokenBatches(DataConfig(kind="synthetic"), "train", SEQ, 10, 2, 2, 0, 2, 0)


def test_eval_batches_are_fixed_and_disjoint_across_ranks(arange_cfg):
    rank0 = batches(arange_cfg, split="val", dp_rank=0, dp_size=2, seed=1).eval_batches(3)
    again = batches(arange_cfg, split="val", dp_rank=0, dp_size=2, seed=9).eval_batches(3)  # seed does not matter
    assert len(rank0) == 3 and all(torch.equal(a[0], b[0]) for a, b in zip(rank0, again, strict=True))
    rank1 = batches(arange_cfg, split="val", dp_rank=1, dp_size=2).eval_batches(3)
    s0, s1 = set(rows(rank0)[0][:, 0].tolist()), set(rows(rank1)[0][:, 0].tolist())
    assert len(s0) == len(s1) == 12 and not s0 & s1
    assert max(s0 | s1) < 3000 - SEQ  # drawn from the val file
    single = rows(batches(arange_cfg, split="val").eval_batches(6))[0]
    assert torch.equal(single, torch.cat([rows(rank0)[0], rows(rank1)[0]]))


def test_stdlib_eval_batches_come_from_val_split(stdlib_cfg):
    val_x, _ = rows(batches(stdlib_cfg, split="val").eval_batches(2))
    train_x, _ = rows(batches(stdlib_cfg, split="train").eval_batches(2))
    assert val_x.shape == (8, SEQ) and not torch.equal(val_x, train_x)


# ---------------------------------------------------------------- memmap and synthetic


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_memmap_reads_both_dtypes(tmp_path, dtype):
    top = 70_000 if dtype == "uint32" else 60_000  # uint32 ids beyond uint16's range must survive
    tokens = np.arange(top - 4000, top, dtype=dtype)
    tokens.tofile(tmp_path / "train.bin")
    tokens[:500].tofile(tmp_path / "val.bin")
    cfg = DataConfig(kind="memmap", train_path=str(tmp_path / "train.bin"), val_path=str(tmp_path / "val.bin"),
                     token_dtype=dtype, vocab_size=top)
    prepare_data(cfg)
    check_vocab(cfg, model_vocab=top)
    x, y = batches(cfg).micro_batches(0)[0]
    assert int(x.min()) >= top - 4000 and int(y.max()) < top and torch.equal(y, x + 1)


def test_memmap_missing_file_names_the_key(arange_cfg, tmp_path):
    cfg = replace(arange_cfg, train_path=str(tmp_path / "nope.bin"))
    with pytest.raises(DataError, match=r"data\.train_path.*not found"):
        prepare_data(cfg)
    with pytest.raises(DataError, match=r"data\.train_path"):
        batches(cfg)


def test_memmap_too_short_file_names_the_key_and_seq_len(arange_cfg, tmp_path):
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "short.bin")
    cfg = replace(arange_cfg, val_path=str(tmp_path / "short.bin"))
    prepare_data(cfg)  # long enough for some seq_len: the check belongs where seq_len is known
    with pytest.raises(DataError, match=r"data\.val_path.*train\.seq_len"):
        batches(cfg, split="val")
    assert batches(cfg, split="val", seq_len=9).micro_batches(0)[0][0].shape == (4, 9)


def test_memmap_empty_or_misaligned_file(arange_cfg, tmp_path):
    (tmp_path / "empty.bin").write_bytes(b"")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(DataError, match=r"data\.train_path.*empty"):
        prepare_data(replace(arange_cfg, train_path=str(tmp_path / "empty.bin")))
    with pytest.raises(DataError, match=r"data\.train_path.*data\.token_dtype"):
        prepare_data(replace(arange_cfg, train_path=str(tmp_path / "odd.bin")))


def test_memmap_unset_path(arange_cfg):
    with pytest.raises(DataError, match=r"data\.val_path is empty"):
        prepare_data(replace(arange_cfg, val_path=""))


def test_token_ids_beyond_vocab_are_caught(arange_cfg):
    small = replace(arange_cfg, vocab_size=100)  # the arange file holds ids up to 4999
    with pytest.raises(DataError, match=r"data\.train_path.*data\.vocab_size=100"):
        check_vocab(small, model_vocab=100)
    with pytest.raises(DataError, match=r"data\.vocab_size"):
        batches(small).micro_batches(0)
    with pytest.raises(DataError, match=r"model\.vocab_size=4000"):
        check_vocab(arange_cfg, model_vocab=4000)
    check_vocab(arange_cfg, model_vocab=5000)


def test_check_vocab_samples_large_files(tmp_path):
    tokens = np.zeros(data_setup._VOCAB_SAMPLE_CHUNKS * data_setup._VOCAB_SAMPLE_TOKENS * 2, dtype=np.uint16)
    tokens[-1] = 900  # the last chunk is always sampled
    tokens.tofile(tmp_path / "big.bin")
    big = str(tmp_path / "big.bin")
    cfg = DataConfig(kind="memmap", train_path=big, val_path=big, vocab_size=512)
    with pytest.raises(DataError, match="token id 900"):
        check_vocab(cfg, model_vocab=1024)


def test_stdlib_needs_a_byte_vocab(stdlib_cfg):
    with pytest.raises(DataError, match=r"model\.vocab_size=128"):
        check_vocab(stdlib_cfg, model_vocab=128)
    check_vocab(stdlib_cfg, model_vocab=256)


def test_synthetic_is_deterministic_within_vocab_and_reads_no_files(tmp_path):
    cfg = DataConfig(kind="synthetic", vocab_size=50, cache_dir=str(tmp_path / "unused"))
    prepare_data(cfg)
    x, y = rows(batches(cfg, grad_accum=2).micro_batches(3))
    assert x.shape == (8, SEQ) and 0 <= int(x.min()) and int(x.max()) < 50 and torch.equal(x[:, 1:], y[:, :-1])
    assert len(set(x.flatten().tolist())) > 40  # actually spread over the vocab
    assert not (tmp_path / "unused").exists()
    val = rows(batches(cfg, split="val").eval_batches(2))[0]
    assert torch.equal(val, rows(batches(cfg, split="val").eval_batches(2))[0])
    assert not torch.equal(val, rows(batches(cfg, split="train").eval_batches(2))[0])


# ---------------------------------------------------------------- config errors


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"kind": "parquet"}, "data.kind"),
        ({"val_fraction": 0.0}, "data.val_fraction"),
        ({"val_fraction": 1.0}, "data.val_fraction"),
        ({"vocab_size": 128}, "data.vocab_size"),
        ({"kind": "memmap", "token_dtype": "int8"}, "data.token_dtype"),
        ({"kind": "memmap", "vocab_size": 70_000}, "data.vocab_size"),
    ],
)
def test_bad_settings_raise_data_error_naming_the_key(change, key, tmp_path):
    with pytest.raises(DataError, match=key.replace(".", r"\.")):
        prepare_data(replace(DataConfig(cache_dir=str(tmp_path)), **change))


def test_negative_seed_is_a_data_error():
    with pytest.raises(DataError, match=r"train\.seed"):
        batches(DataConfig(kind="synthetic"), seed=-1)


# ---------------------------------------------------------------- resume position


@pytest.mark.parametrize("source", ["memmap", "synthetic"])
def test_resume_continues_the_sample_stream_with_another_world_and_batch(source, arange_cfg):
    cfg = {"memmap": arange_cfg, "synthetic": DataConfig(kind="synthetic", vocab_size=1000)}[source]
    # Uninterrupted: 3 steps of 4 samples on one rank -> stream samples 0..11.
    straight = torch.cat([rows(batches(cfg, micro_batch=4).micro_batches(s))[0] for s in range(3)])
    # Interrupted after step 1 (8 samples seen), resumed on 2 ranks with a global batch of 2 per step.
    resumed = []
    for step in (1, 2):
        for r in range(2):
            b = batches(cfg, dp_rank=r, dp_size=2, micro_batch=1)
            b.resume_at(step=1, samples_seen=8)
            resumed.append(rows(b.micro_batches(step))[0])
    assert torch.equal(torch.cat(resumed), straight[8:12])


def test_samples_across_a_block_boundary_are_the_stream_samples(arange_cfg):
    b = batches(arange_cfg, micro_batch=4)
    b.resume_at(step=0, samples_seen=1022)
    got = rows(b.micro_batches(0))[0][:, 0].tolist()
    draws = [np.random.default_rng([0, k]).integers(0, 5000 - SEQ, size=1024) for k in (0, 1)]
    assert got == [int(draws[0][1022]), int(draws[0][1023]), int(draws[1][0]), int(draws[1][1])]


def test_sample_ids_name_the_stream_samples_each_rank_reads(arange_cfg):
    """sample_ids is what micro_batches reads: rank r's micro-batch a is samples r*A*M + a*M ... of the step, so the
    ranks' ids in order are the step's global batch, whatever the split (4 = 2 ranks x 1 x 2 = 1 rank x 2 x 2)."""
    two = [batches(arange_cfg, dp_rank=r, dp_size=2, micro_batch=2) for r in range(2)]
    one = batches(arange_cfg, micro_batch=2, grad_accum=2)
    for b in (*two, one):
        b.resume_at(step=3, samples_seen=40)
    by_two = [j for b in two for micro in b.sample_ids(4) for j in micro]
    by_one = [j for micro in one.sample_ids(4) for j in micro]
    assert by_two == by_one == list(range(44, 48))
    assert torch.equal(torch.cat([rows(b.micro_batches(4))[0] for b in two]), rows(one.micro_batches(4))[0])
    # The ids name what is read: sample 44's window starts at the stream's draw 44 (arange tokens: token = offset).
    assert rows(one.micro_batches(4))[0][0, 0].item() == int(np.random.default_rng([0, 0]).integers(
        0, 5000 - SEQ, size=1024)[44])
