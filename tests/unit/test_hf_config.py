"""Hugging Face folders on the launcher side: model=hf's shape, checkpoint.init_from's checks, the name mapping."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import write_hf_weights
from trainctl.config.compose import compose
from trainctl.config.errors import ConfigError
from trainctl.config.hf_config import model_fields
from trainctl.config.schema import ModelConfig
from trainctl.config.validate import resolve
from trainctl.models.build import build_model
from trainctl.models.hf import from_hf, from_hf_name, from_hf_rows, to_hf, to_hf_name, to_hf_rows

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 176, "vocab_size": 300, "max_position_embeddings": 128,
         "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False}


def hf_folder(root, config: dict, weights: bool = True):
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    if weights:
        write_hf_weights(root)
    return root


def test_model_hf_takes_the_shape_from_config_json(tmp_path):
    folder = hf_folder(tmp_path / "llama", LLAMA)
    cfg = resolve(compose(["model=hf", f"model.path={folder}", "data=synthetic", "train.seq_len=64"]))
    m = cfg.model
    assert (m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim, m.vocab_size) == (64, 2, 4, 2, 176, 300)
    assert (m.max_seq_len, m.norm_eps, m.rope_theta, m.tie_embeddings) == (128, 1e-5, 500000.0, False)


# As meta-llama/Llama-3.2-1B's config.json writes it.
LLAMA32_ROPE = {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])  # transformers < 5 and >= 5
def test_llama3_rope_scaling_is_read_into_the_model(tmp_path, key):
    folder = hf_folder(tmp_path / "llama", {**LLAMA, key: LLAMA32_ROPE})
    m = resolve(compose(["model=hf", f"model.path={folder}", "data=synthetic", "train.seq_len=64"])).model
    assert (m.rope_scaling, m.rope_factor, m.rope_low_freq_factor, m.rope_high_freq_factor,
            m.rope_original_max_seq_len) == ("llama3", 32.0, 1.0, 4.0, 8192)
    # A model without the scaling does not silently take those weights (init_from compares the shape).
    plain = hf_folder(tmp_path / "plain", LLAMA)
    (line,) = _init_from_problems(folder, "model=hf", f"model.path={plain}", "data=synthetic", "train.seq_len=64")
    assert "rope_scaling=llama3 (model.rope_scaling=none)" in line, line


def _init_from_problems(folder, *overrides) -> list[str]:
    with pytest.raises(ConfigError) as err:
        resolve(compose([*overrides, f"checkpoint.init_from={folder}"]))
    return err.value.problems


@pytest.mark.parametrize(("change", "words"), [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 8.0}}, "rope_scaling.rope_type='yarn': not implemented"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_parameters.rope_type='dynamic'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.low_freq_factor=null"),
    ({"rope_scaling": {"rope_type": "linear", "factor": -1}}, "rope_scaling.factor=-1"),
    ({"rope_scaling": {"factor": 2.0}}, "no rope_type"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "attention_factor": 0.5}}, "attention_factor=0.5"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"head_dim": "32"}, "head_dim='32'"),
    ({"model_type": "gemma"}, "model_type='gemma'"),
    ({"model_type": "qwen3", "attention_bias": True}, "attention_bias=true"),
    ({"model_type": "mistral", "sliding_window": 0}, "sliding_window=0"),
])
def test_configs_trainctl_cannot_reproduce_are_refused_in_one_line(tmp_path, change, words):
    folder = hf_folder(tmp_path / "x", {**LLAMA, **change}, weights=False)  # model.path reads config.json only
    with pytest.raises(ConfigError) as err:
        resolve(compose(["model=hf", f"model.path={folder}"]))
    (line,) = err.value.problems
    assert line.startswith(f"model.path={folder}") and words in line


def test_model_hf_without_a_path_or_with_a_bad_one_is_one_line(tmp_path):
    with pytest.raises(ConfigError) as err:
        resolve(compose(["model=hf"]))
    assert len(err.value.problems) == 1 and "model.path" in err.value.problems[0]
    for bad in (tmp_path / "missing", hf_folder(tmp_path / "empty", LLAMA).parent):
        with pytest.raises(ConfigError) as err:
            resolve(compose(["model=hf", f"model.path={bad}"]))
        assert len(err.value.problems) == 1


def test_init_from_checks_weights_and_shape_before_launch(tmp_path):
    folder = hf_folder(tmp_path / "llama", LLAMA)
    ok = resolve(compose(["model=hf", f"model.path={folder}", f"checkpoint.init_from={folder}", "data=synthetic",
                          "train.seq_len=64"]))
    assert ok.checkpoint.init_from == str(folder)
    with pytest.raises(ConfigError) as err:  # the shipped tiny model is not that shape
        resolve(compose([f"checkpoint.init_from={folder}"]))
    (line,) = err.value.problems
    assert "dim=64 (model.dim=256)" in line and "model=hf" in line
    no_weights = hf_folder(tmp_path / "bare", LLAMA, weights=False)
    with pytest.raises(ConfigError) as err:
        resolve(compose(["model=hf", f"model.path={no_weights}", f"checkpoint.init_from={no_weights}"]))
    assert "model.safetensors" in err.value.problems[0]


def test_rope_parameters_of_newer_transformers_are_read(tmp_path):
    config = {k: v for k, v in LLAMA.items() if k != "rope_theta"}
    folder = hf_folder(tmp_path / "v5", {**config, "rope_parameters": {"rope_type": "default", "rope_theta": 7.0}})
    assert model_fields(folder)["rope_theta"] == 7.0


def test_every_tensor_name_maps_both_ways():
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=128)
    names = list(build_model(cfg, "meta").state_dict())
    theirs = [to_hf_name(n) for n in names]
    assert len(set(theirs)) == len(names) and "model.layers.1.self_attn.k_proj.weight" in theirs
    assert [from_hf_name(n) for n in theirs] == names
    assert from_hf_name("model.layers.0.self_attn.rotary_emb.inv_freq") is None


@pytest.mark.parametrize("heads", [1, 2, 4])
def test_rotary_row_orders_are_inverse_and_move_pairs_to_halves(heads):
    head_dim, dim = 8, 16
    w = torch.arange(heads * head_dim * dim, dtype=torch.float32).reshape(heads * head_dim, dim)
    assert torch.equal(from_hf_rows(to_hf_rows(w, heads), heads), w)
    moved = to_hf_rows(w, heads)
    # Interleaved pair (2i, 2i+1) of head h lands at rows (i, i + head_dim/2) of that head.
    for h in range(heads):
        for i in range(head_dim // 2):
            assert torch.equal(moved[h * head_dim + i], w[h * head_dim + 2 * i])
            assert torch.equal(moved[h * head_dim + head_dim // 2 + i], w[h * head_dim + 2 * i + 1])


def test_only_q_and_k_are_reordered():
    cfg = ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=64)
    for name, shape in (("layers.0.attention.wv.weight", (16, 32)), ("layers.0.attention.wk.weight", (16, 32))):
        w = torch.randn(shape)
        hf_name, moved = to_hf(name, w, cfg)
        assert torch.equal(moved, w) == name.endswith("wv.weight")
        assert torch.equal(from_hf(hf_name, moved, cfg)[1], w)


PLAIN = ["model=hf", "data=synthetic", "train.seq_len=64"]


def test_an_index_naming_a_file_outside_the_folder_is_refused(tmp_path):
    folder = hf_folder(tmp_path / "llama", LLAMA)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (folder / "model.safetensors").rename(outside / "x.safetensors")
    for name in ("../elsewhere/x.safetensors", str(outside / "x.safetensors"), "sub/../../elsewhere/x.safetensors"):
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": name}}))
        (line,) = _init_from_problems(folder, *PLAIN, f"model.path={folder}")
        assert "outside" in line and repr(name) in line, line


def test_init_from_tensors_are_checked_against_the_family_before_launch(tmp_path):
    folder = hf_folder(tmp_path / "llama", LLAMA, weights=False)
    cases = {"no tensor model.norm.weight": {"drop": ("model.norm.weight",)},
             "model.vision.weight is not part of the llama model": {"extra": {"model.vision.weight": [4, 4]}},
             "model.layers.0.self_attn.q_proj.bias is not part": {"extra": {"model.layers.0.self_attn.q_proj.bias":
                                                                          [64]}},
             "lm_head.weight has shape [300, 32]": {"drop": ("lm_head.weight",), "extra": {"lm_head.weight":
                                                                                          [300, 32]}}}
    for words, change in cases.items():
        write_hf_weights(folder, **change)
        (line,) = _init_from_problems(folder, *PLAIN, f"model.path={folder}")
        assert line.startswith(f"checkpoint.init_from={folder}") and words in line, line


def test_a_tied_folder_shipping_another_head_is_refused_and_the_same_head_is_taken(tmp_path):
    folder = hf_folder(tmp_path / "llama", {**LLAMA, "tie_word_embeddings": True}, weights=False)
    embedding = bytes(4 * 300 * 64)
    write_hf_weights(folder, head=embedding)  # what save_pretrained writes for a tied model: the same matrix
    resolve(compose([*PLAIN, f"model.path={folder}", f"checkpoint.init_from={folder}"]))
    write_hf_weights(folder, head=b"\x01" + embedding[1:])
    (line,) = _init_from_problems(folder, *PLAIN, f"model.path={folder}")
    assert "tie_word_embeddings true, but lm_head.weight differs" in line, line


def test_the_worker_refuses_a_tensor_the_model_has_no_place_for(tmp_path):
    from trainctl.models.hf import HFWeightsError, load_hf_weights

    folder = hf_folder(tmp_path / "llama", LLAMA, weights=False)
    m = ModelConfig(**model_fields(folder))
    model = build_model(m, "cpu")
    write_hf_weights(folder)
    assert load_hf_weights(model, folder, m) == len(model.state_dict())
    write_hf_weights(folder, extra={"model.layers.0.mlp.gate_proj.bias": [176]})
    with pytest.raises(HFWeightsError, match="gate_proj.bias is not part of the llama model"):
        load_hf_weights(model, folder, m)


@pytest.mark.dist  # transformers builds and saves each model: seconds, not the unit loop's milliseconds
@pytest.mark.parametrize("name", ["tied", "qwen3"])  # a tied head; a family with more tensors (q/k norms)
def test_folders_transformers_saves_pass_the_header_checks(tmp_path, name):
    # The checks above refuse what transformers never writes: every family's own folder (sharded: an index) passes.
    transformers = pytest.importorskip("transformers")
    from tests.dist.test_hf import SHAPES, save_random_model

    model_type, shape = SHAPES[name]
    folder = tmp_path / name
    save_random_model(folder, transformers.AutoConfig.for_model(model_type, **shape), max_shard_size="20KB")
    assert (folder / "model.safetensors.index.json").is_file()
    resolve(compose([*PLAIN, f"model.path={folder}", f"checkpoint.init_from={folder}"]))
