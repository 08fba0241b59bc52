"""Llama 3.1/3.2 checkpoints (RoPE scaling `llama3`) and linear RoPE scaling, against transformers itself.

One process, fp32: a random LlamaForCausalLM with the scaling, saved by save_pretrained, loads into trainctl (its
config.json read by model=hf's reader, its weights by the worker's loader) and gives transformers' logits over a
sequence longer than the original context, where the scaling changes the angles. The layouts (DDP, FSDP2, TP) run
the same folders in test_hf.py. The export writes the scaling back in the published files' form.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from tests.dist.test_hf import save_random_llama
from trainctl.config.hf_config import model_fields
from trainctl.config.schema import ModelConfig
from trainctl.models.hf import hf_config, load_hf_weights
from trainctl.models.llama import build_model

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.dist
TOL = 1e-4
BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=176,
            vocab_size=300, max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-5,
            tie_word_embeddings=False)
# original_max 32 over head dim 16 and theta 1e4: one frequency kept, one on the ramp, six divided by the factor.
SCALINGS = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "linear": {"rope_type": "linear", "factor": 4.0},
}


def trainctl_model(cfg: ModelConfig, folder) -> torch.nn.Module:
    torch.manual_seed(1234)
    model = build_model(cfg, "meta")
    model.to_empty(device="cpu")
    model.init_weights()
    assert load_hf_weights(model, folder, cfg) > 0
    return model.eval()


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_scaled_rope_logits_equal_transformers(kind, tmp_path):
    hf = save_random_llama(tmp_path, {**BASE, "rope_scaling": SCALINGS[kind]})
    with torch.no_grad():  # sharper attention than a 0.02-std init gives, so the positions' angles matter
        for name, param in hf.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(20)
    hf.save_pretrained(tmp_path)
    published = json.loads((tmp_path / "config.json").read_text())
    assert "rope" in json.dumps(published) and kind in json.dumps(published)
    cfg = ModelConfig(name="hf", **model_fields(tmp_path))
    assert cfg.rope_scaling == kind and cfg.rope_factor == SCALINGS[kind]["factor"]
    tokens = torch.randint(0, 300, (2, 96), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = trainctl_model(cfg, tmp_path)(tokens)
        plain = trainctl_model(replace(cfg, rope_scaling="none"), tmp_path)(tokens)
    assert (got - expected).abs().max().item() <= TOL
    # The test can fail: the same weights without the scaling are far from transformers'.
    assert (plain - expected).abs().max().item() > 1000 * TOL


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_the_export_config_rebuilds_the_same_rope_in_transformers(kind, tmp_path):
    save_random_llama(tmp_path, {**BASE, "rope_scaling": SCALINGS[kind]})
    cfg = ModelConfig(name="hf", **model_fields(tmp_path))
    exported = hf_config(cfg, torch.float32)
    assert ModelConfig(name="hf", **_fields_of(exported, tmp_path)) == cfg
    ours = transformers.LlamaConfig(**{k: v for k, v in exported.items() if k != "torch_dtype"})
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    rope = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS[kind]
    assert torch.equal(rope(ours, "cpu")[0], rope(theirs, "cpu")[0])


def _fields_of(config: dict, folder) -> dict:
    other = folder / "again"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(config))
    return model_fields(other)


# The published models' configurations as trainctl ships them: the plan's count equals transformers' own class.
PUBLISHED = ["llama3_2_1b", "llama3_2_3b", "llama3_1_8b", "llama3_1_70b", "llama2_7b"]


@pytest.mark.parametrize("name", PUBLISHED)
def test_plan_count_equals_transformers_built_on_meta(name):
    from trainctl.config.compose import compose
    from trainctl.plan.flops import param_count

    cfg = compose([f"model={name}"]).model
    config = transformers.LlamaConfig(**{k: v for k, v in hf_config(cfg, torch.bfloat16).items() if k != "torch_dtype"})
    with torch.device("meta"):
        reference = transformers.LlamaForCausalLM(config)
    assert param_count(cfg) == sum(p.numel() for p in reference.parameters())  # tied weights counted once
    assert reference.config.rope_parameters["rope_type"] == ("llama3" if name.startswith("llama3") else "default")
