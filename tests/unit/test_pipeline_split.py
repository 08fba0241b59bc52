"""The pipeline split: which blocks each stage holds, and that the parts are the full model, cut.

The parts keep the full model's parameter names, start from the same weights (init does not
depend on the split), and chained together compute the same logits.
"""

import pytest
import torch

from trainctl.config.schema import ModelConfig, PrecisionConfig, ShardingConfig
from trainctl.core.stages import local_stage_ids, stage_layers
from trainctl.core.support import unsupported
from trainctl.models.build import build_model
from trainctl.train.parallel.pipeline import build_stage_model

CFG = ModelConfig(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=64, max_seq_len=32)


def test_even_split_puts_the_remainder_on_the_first_stages():
    assert stage_layers(4, 2, []) == [range(0, 2), range(2, 4)]
    assert stage_layers(5, 3, []) == [range(0, 2), range(2, 4), range(4, 5)]


def test_explicit_split_follows_pp_layers():
    assert stage_layers(4, 2, [1, 3]) == [range(0, 1), range(1, 4)]


def test_looped_placement():
    assert local_stage_ids(0, 2, 1) == [0]
    assert local_stage_ids(1, 2, 2) == [1, 3]
    assert local_stage_ids(2, 4, 3) == [2, 6, 10]


def _materialize(model, seed: int = 3):
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def _parts(layers: list[int]):
    ranges = stage_layers(CFG.n_layers, len(layers), layers)
    last = len(ranges) - 1
    return [_materialize(build_stage_model(CFG, r, first=i == 0, last=i == last)) for i, r in enumerate(ranges)]


def test_stage_holds_only_its_blocks_and_ends():
    first, middle, last = (
        build_stage_model(CFG, r, first=i == 0, last=i == 2) for i, r in enumerate(stage_layers(4, 3, [1, 2, 1]))
    )
    assert list(first.layers.keys()) == ["0"] and first.tok_embeddings is not None and first.output is None
    assert list(middle.layers.keys()) == ["1", "2"] and middle.tok_embeddings is None and middle.norm is None
    assert list(last.layers.keys()) == ["3"] and last.norm is not None and last.output is not None


@pytest.mark.parametrize("layers", [[2, 2], [1, 3], [1, 1, 1, 1]])
def test_parts_start_from_the_full_models_weights(layers):
    full = dict(_materialize(build_model(CFG)).named_parameters())
    seen = set()
    for part in _parts(layers):
        for name, param in part.named_parameters():
            assert torch.equal(param, full[name]), name
            seen.add(name)
    assert seen == set(full)


@pytest.mark.parity
def test_chained_parts_compute_the_full_models_logits():
    full = _materialize(build_model(CFG))
    tokens = torch.randint(0, CFG.vocab_size, (2, 16))
    h = tokens
    for part in _parts([1, 3]):
        h = part(h)
    # The parts are the full model's modules run on the same tensors in the same order: bitwise equal.
    torch.testing.assert_close(h, full(tokens), rtol=0, atol=0)


def test_init_still_depends_on_the_seed():
    a, b = _materialize(build_model(CFG), seed=1), _materialize(build_model(CFG), seed=2)
    assert not torch.equal(a.layers["2"].feed_forward.w1.weight, b.layers["2"].feed_forward.w1.weight)
    assert not torch.equal(a.tok_embeddings.weight, b.tok_embeddings.weight)


def test_pipeline_is_supported_except_under_zero1():
    assert unsupported(ShardingConfig(strategy="fsdp", dp_shard=2, pp=2), PrecisionConfig()) == []
    refused = unsupported(ShardingConfig(strategy="zero1", dp_replicate=2, pp=2), PrecisionConfig())
    assert len(refused) == 1 and refused[0].startswith("sharding.strategy=zero1") and "sharding.pp=2" in refused[0]
