"""The worker reads prepared datasets (all their shards, several blended), and the launcher checks them first."""

from __future__ import annotations

import numpy as np
import pytest

from trainctl.config.compose import compose
from trainctl.config.errors import ConfigError
from trainctl.config.schema import DataConfig
from trainctl.config.validate import resolve
from trainctl.data.prepare import prepare
from trainctl.train.loop.data import TokenBatches
from trainctl.train.loop.sources import ShardedTokens


def make_dataset(root, name: str, letter: str, docs: int = 40, shard_tokens: int = 500):
    text = root / f"text-{name}"
    text.mkdir(parents=True)
    for i in range(docs):
        (text / f"{i:03d}.txt").write_text(letter * (50 + i))
    prepare([str(text)], root / name, val_fraction=0.2, shard_tokens=shard_tokens, workers=1)
    return root / name


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("datasets")
    return make_dataset(root, "a", "a"), make_dataset(root, "b", "b", docs=20)


def batches(cfg: DataConfig, split="train", seq_len=16, global_batch=8, seed=0) -> TokenBatches:
    return TokenBatches(cfg, split, seq_len=seq_len, global_batch=global_batch, micro_batch=global_batch,
                        grad_accum=1, dp_rank=0, dp_size=1, seed=seed)


def test_windows_span_shards_exactly():
    shards = [np.arange(0, 5, dtype=np.uint16), np.arange(5, 7, dtype=np.uint16), np.arange(7, 20, dtype=np.uint16)]
    tokens = ShardedTokens(shards)
    for start in range(0, tokens.num_starts(6)):
        assert np.array_equal(tokens.window(start, 6), np.arange(start, start + 6))


def test_every_shard_of_a_dataset_is_read(datasets):
    a, _ = datasets
    cfg = DataConfig(kind="memmap", datasets=[str(a)], vocab_size=256)
    seen = np.concatenate([x.numpy().ravel() for step in range(30) for x, _ in batches(cfg).micro_batches(step)])
    assert set(np.unique(seen)) == {0, ord("a")}  # letters and the EOS between documents
    assert len(list(a.glob("train-*.bin"))) > 3


@pytest.mark.parametrize("weights", [[], [1.0, 1.0], [1.0, 4.0]])
def test_blend_weights_set_each_datasets_share(datasets, weights):
    a, b = datasets
    cfg = DataConfig(kind="memmap", datasets=[str(a), str(b)], weights=weights, vocab_size=256)
    rows = [x.numpy() for step in range(200) for x, _ in batches(cfg, seq_len=8).micro_batches(step)]
    from_b = np.mean([np.any(r == ord("b"), axis=1).mean() for r in rows])
    tokens = [sum(p.stat().st_size for p in d.glob("train-*.bin")) for d in (a, b)]
    expected = weights[1] / sum(weights) if weights else tokens[1] / sum(tokens)
    assert abs(from_b - expected) < 0.05, (from_b, expected)


def test_a_resume_reads_the_same_samples_as_an_unbroken_run(datasets):
    a, b = datasets
    cfg = DataConfig(kind="memmap", datasets=[str(a), str(b)], weights=[2.0, 1.0], vocab_size=256)
    unbroken = [x for step in range(6) for x, _ in batches(cfg).micro_batches(step)]
    resumed = batches(cfg)
    resumed.resume_at(3, 3 * 8)
    later = [x for step in range(3, 6) for x, _ in resumed.micro_batches(step)]
    assert all(np.array_equal(u, r) for u, r in zip(unbroken[3:], later, strict=True))


def test_eval_reads_the_val_split(datasets):
    a, _ = datasets
    cfg = DataConfig(kind="memmap", datasets=[str(a)], vocab_size=256)
    val = batches(cfg, split="val")
    assert val.num_tokens == sum(p.stat().st_size // 2 for p in a.glob("val-*.bin"))
    assert len(val.eval_batches(2)) == 2


# ---------------------------------------------------------------- checked at compose time


def composed(*overrides: str):
    return resolve(compose(["recipe=tiny_cpu", "data=memmap", *overrides]))


def test_a_good_dataset_composes_and_a_bad_one_is_one_line_each(datasets, tmp_path):
    a, b = datasets
    cfg = composed(f"data.datasets=[{a},{b}]", "data.weights=[3,1]", "train.seq_len=32")
    assert cfg.data.datasets == [str(a), str(b)]
    with pytest.raises(ConfigError) as err:
        composed(f"data.datasets=[{tmp_path / 'nope'},{a}]", "data.weights=[1]")
    problems = err.value.problems
    assert len(problems) == 2
    assert any("no such folder" in p for p in problems)
    assert any("one positive weight per dataset" in p for p in problems)


def test_a_dataset_too_small_or_with_a_bigger_vocabulary_is_refused(datasets):
    a, _ = datasets
    with pytest.raises(ConfigError) as err:
        composed(f"data.datasets=[{a}]", "train.seq_len=1000")
    assert any("fewer than train.seq_len+1" in p for p in err.value.problems)
    with pytest.raises(ConfigError) as err:
        composed(f"data.datasets=[{a}]", "model.vocab_size=128", "data.vocab_size=0")
    assert any("exceeds model.vocab_size 128" in p for p in err.value.problems)


def test_the_plan_says_how_many_epochs(datasets):
    from trainctl.plan import build

    a, _ = datasets
    plan = build(composed(f"data.datasets=[{a}]", "train.steps=100"))
    assert any("epochs of the training tokens" in w for w in plan.warnings)
