"""Each family's torch-free spec against its own module, and the family-specific config checks.

The spec is what the plan counts (parameters, FLOPs, activation bytes, TP splits) and what the HF import and
export map; tests/dist/test_families.py checks the same specs against transformers' classes.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from trainctl.config.compose import compose
from trainctl.config.errors import ConfigError
from trainctl.config.schema import ModelConfig, MoEConfig
from trainctl.config.validate import resolve
from trainctl.models import registry
from trainctl.plan.activations import ActLayout, block_none
from trainctl.plan.flops import flops_per_token
from trainctl.plan.shapes import block_tensors, tp_local

SMALL = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=64, max_seq_len=64)
# Per family, a small shape that exercises what sets it apart (qwen3: head_dim 16 on a 32 stream of 4 heads).
SHAPES = {"llama": replace(SMALL, rope_scaling="llama3", rope_factor=8.0, rope_original_max_seq_len=16),
          "qwen2": replace(SMALL, family="qwen2", tie_embeddings=True),
          "qwen3": replace(SMALL, family="qwen3", head_dim=16),
          "mistral": replace(SMALL, family="mistral", sliding_window=64),
          "qwen3_moe": replace(SMALL, family="qwen3_moe", head_dim=16,
                               moe=MoEConfig(num_experts=4, experts_per_token=2, expert_ffn_dim=16)),
          "mixtral": replace(SMALL, family="mixtral", ffn_dim=16,
                             moe=MoEConfig(num_experts=4, experts_per_token=2, expert_ffn_dim=16,
                                           router="topk_softmax"))}


def test_every_family_has_a_small_shape_here():
    assert set(SHAPES) == set(registry.names())


@pytest.mark.parametrize("family", sorted(SHAPES))
def test_spec_tensors_are_the_modules_parameters_in_order(family):
    from trainctl.models.build import build_model

    cfg = SHAPES[family]
    module = build_model(cfg, "meta")
    # A stacked expert weight [E, a, b] is a Tensor of E rows of a x b (models/common/moe_shape.py).
    block = [(n.removeprefix("layers.0."), (p.shape[0],) if p.ndim == 1 else (p.shape[0], p[0].numel()))
             for n, p in module.named_parameters() if n.startswith("layers.0.")]
    spec = [(t.name.removeprefix("layers.0."), (t.rows,) if t.cols == 1 else (t.rows, t.cols))
            for t in block_tensors(cfg, 0)]
    assert spec == block
    assert registry.spec(family).param_count(cfg) == sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("family", sorted(SHAPES))
def test_checkpoint_names_are_the_specs_tensors(family):
    """Every key of the module's state dict is a tensor the spec declares, in order: checkpoints (DCP keys) and
    the HF name maps are written against these names, so a refactor of the module classes must keep them.

    A tied output weight is one parameter under two names: the state dict lists it again after the norm."""
    from trainctl.models.build import build_model
    from trainctl.plan.shapes import stage_tensors

    cfg = SHAPES[family]
    declared = [t.name for t in stage_tensors(cfg, range(cfg.n_layers), first=True, last=True)]
    tied = ["output.weight"] if cfg.tie_embeddings else []
    assert list(build_model(cfg, "meta").state_dict()) == declared + tied


@pytest.mark.parametrize("family", sorted(SHAPES))
def test_config_json_round_trips_through_the_spec(family, tmp_path):
    from trainctl.config.hf_config import model_fields

    cfg = SHAPES[family]
    folder = tmp_path / family
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(registry.spec(family).to_hf(cfg)))
    fields = model_fields(folder)
    expected = {k: getattr(cfg, k) for k in fields}
    if "moe" in fields:  # a mixture of experts' shape keys (its training knobs are not config.json's)
        expected["moe"] = {k: getattr(cfg.moe, k) for k in fields["moe"]}
    assert expected == fields


def test_qwen3_flops_and_activations_use_its_head_dim_and_norms():
    """Qwen3 0.6B: 16 heads of 128 on a 1024 stream: attention works on 2048 wide q, not 1024."""
    cfg = compose(["model=qwen3_0_6b", "data=synthetic"]).model
    as_llama = replace(cfg, family="llama")  # same shape without the q/k norms
    q = 16 * 128
    kv = 8 * 128
    per_block = 1024 * (2 * q + 2 * kv) + 3 * 1024 * 3072
    assert flops_per_token(cfg, 4096) == 6.0 * (28 * per_block + 151936 * 1024) + 12.0 * 28 * q * 4096
    lay = ActLayout(compute_bytes=2, residual_bytes=4)
    # The per-head norms keep their fp32 input, x * rstd and one rstd per head (q and k heads).
    assert block_none(cfg, lay) - block_none(as_llama, lay) == 8 * (16 + 8) * 128 + 4 * (16 + 8)


def test_qwen2_biases_split_with_their_rows_under_tp_and_qwen3_norms_stay_whole():
    qwen2 = {t.name.removeprefix("layers.0."): t for t in block_tensors(SHAPES["qwen2"], 0)}
    assert tp_local(qwen2["attention.wq.bias"], 2, "qwen2").rows == 16
    assert tp_local(qwen2["attention.wv.bias"], 2, "qwen2").rows == 8
    qwen3 = {t.name.removeprefix("layers.0."): t for t in block_tensors(SHAPES["qwen3"], 0)}
    assert tp_local(qwen3["attention.q_norm.weight"], 2, "qwen3").rows == 16


def test_a_sliding_window_shorter_than_the_sequence_is_one_line_naming_the_key():
    with pytest.raises(ConfigError) as err:
        resolve(compose(["model=mistral_7b", "model.sliding_window=4096", "train.seq_len=8192", "data=synthetic"]))
    (line,) = err.value.problems
    assert line.startswith("model.sliding_window=4096: shorter than train.seq_len=8192")
    cfg = resolve(compose(["model=mistral_7b", "model.sliding_window=4096", "train.seq_len=4096",
                           "data=synthetic"]))
    assert cfg.model.sliding_window == 4096


def write_config(folder: Path, data: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(data))
    return folder


QWEN3 = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 128, "vocab_size": 300,
         "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": True,
         "use_sliding_window": False, "sliding_window": None}


def test_model_hf_reads_the_family_from_config_json(tmp_path):
    from trainctl.config.hf_config import model_fields

    fields = model_fields(write_config(tmp_path / "q", QWEN3))
    assert (fields["family"], fields["head_dim"], fields["sliding_window"]) == ("qwen3", 32, 0)
    by_architecture = {**QWEN3, "model_type": "custom", "architectures": ["Qwen3ForCausalLM"]}
    assert model_fields(write_config(tmp_path / "a", by_architecture))["family"] == "qwen3"
    mistral = {**QWEN3, "model_type": "mistral", "head_dim": None, "sliding_window": 4096}
    del mistral["use_sliding_window"]
    assert model_fields(write_config(tmp_path / "m", mistral))["sliding_window"] == 4096


@pytest.mark.parametrize(("change", "words"), [
    ({"use_sliding_window": True, "sliding_window": 64}, "use_sliding_window=true"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type='dynamic': not implemented"),
])
def test_what_a_family_cannot_reproduce_is_one_line(tmp_path, change, words):
    folder = write_config(tmp_path / "q", {**QWEN3, **change})
    with pytest.raises(ConfigError) as err:
        resolve(compose(["model=hf", f"model.path={folder}", "data=synthetic", "train.seq_len=64"]))
    (line,) = err.value.problems
    assert line.startswith(f"model.path={folder}") and words in line


def test_an_unknown_family_is_one_line_with_the_choices():
    with pytest.raises(ConfigError) as err:
        resolve(compose(["model.family=gpt2", "data=synthetic"]))
    assert err.value.problems == ["model.family='gpt2': unknown family; choose one of: llama, mistral, mixtral, qwen2, "
                                    "qwen3, qwen3_moe"]
