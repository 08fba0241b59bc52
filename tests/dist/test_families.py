"""Every family against transformers' own classes: parameter counts of the published models, one-process fp32
logits of imported weights (through models/hf.py), and the export's names and config.json.

The published configs are written here from the model cards' config.json (no network); transformers builds
them on the meta device (no memory), and the plan's count must equal the sum of their numel.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.dist.test_hf import SHAPES, logits_bound, random_hf_model

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.dist

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
# (trainctl model config, model_type, transformers config of the published model)
PUBLISHED = {
    "llama3_2_1b": ("llama", dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                  intermediate_size=8192, vocab_size=128256, max_position_embeddings=131072,
                                  rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, rms_norm_eps=1e-5,
                                  tie_word_embeddings=True)),
    "llama3_1_8b": ("llama", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                  intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072,
                                  rope_theta=500000.0, rope_scaling={**LLAMA3_ROPE, "factor": 8.0},
                                  rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "qwen2_5_7b": ("qwen2", dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                 intermediate_size=18944, vocab_size=152064, max_position_embeddings=131072,
                                 rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "qwen2_5_0_5b": ("qwen2", dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                                   num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                                   max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                                   tie_word_embeddings=True)),
    "qwen3_8b": ("qwen3", dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                               head_dim=128, intermediate_size=12288, vocab_size=151936, max_position_embeddings=40960,
                               rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "qwen3_0_6b": ("qwen3", dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                 head_dim=128, intermediate_size=3072, vocab_size=151936,
                                 max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
                                 tie_word_embeddings=True)),
    "mistral_7b": ("mistral", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                   num_key_value_heads=8, intermediate_size=14336, vocab_size=32768,
                                   max_position_embeddings=32768, rope_theta=1e6, sliding_window=None,
                                   rms_norm_eps=1e-5, tie_word_embeddings=False)),
}


def hf_folder_config(folder: Path, model_type: str, shape: dict) -> Path:
    """A folder holding only the published config.json (as transformers writes it), for model=hf."""
    folder.mkdir(parents=True, exist_ok=True)
    transformers.AutoConfig.for_model(model_type, **shape).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_plan_parameter_count_equals_transformers(name, tmp_path):
    """The shipped model YAML and the same model read from its config.json (model=hf) both count exactly what
    transformers' class holds."""
    from trainctl.config.compose import compose
    from trainctl.config.validate import resolve
    from trainctl.plan.flops import param_count

    model_type, shape = PUBLISHED[name]
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(model_type,
                                                                                                    **shape))
    expected = sum(p.numel() for p in reference.parameters())
    shipped = compose([f"model={name}", "data=synthetic", "train.seq_len=1024"]).model
    assert param_count(shipped) == expected
    folder = hf_folder_config(tmp_path / name, model_type, shape)
    read = resolve(compose(["model=hf", f"model.path={folder}", "data=synthetic", "train.seq_len=1024"])).model
    assert read.family == shipped.family and param_count(read) == expected
    # The YAML says what the config.json says, rope scaling and head size included.
    differ = {k: (v, getattr(read, k)) for k, v in vars(shipped).items()
              if k not in ("name", "path", "max_seq_len") and getattr(read, k) != v}
    assert differ == {}


def ours_from(folder: Path):
    """The family's model built as the worker builds it, randomly initialized, then loaded from `folder`."""
    from trainctl.config.hf_config import model_fields
    from trainctl.config.schema import ModelConfig
    from trainctl.models.build import build_model
    from trainctl.models.hf import load_hf_weights

    cfg = ModelConfig(**model_fields(folder))
    model = build_model(cfg, "cpu")
    torch.manual_seed(1)
    model.init_weights()
    assert load_hf_weights(model, folder, cfg) == len(list(model.parameters()))
    return cfg, model.eval()


# One-process only (the layouts of test_hf.py run SHAPES): linear RoPE scaling on the gqa shape.
VARIANTS = {name: (name, {}) for name in SHAPES} | {"linear_rope": ("gqa", {"rope_scaling": {"rope_type": "linear",
                                                                                          "factor": 4.0}})}


@pytest.fixture(scope="module", params=list(VARIANTS))
def imported(request, tmp_path_factory):
    name = request.param
    folder = tmp_path_factory.mktemp(f"fam-{name}")
    shape, changes = VARIANTS[name]
    theirs = random_hf_model(shape, seed=5, **changes)
    theirs.save_pretrained(folder)
    cfg, ours = ours_from(folder)
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
    return name, theirs, cfg, ours, tokens


@pytest.mark.parity
def test_imported_logits_equal_transformers_in_one_process(imported):
    name, theirs, cfg, ours, tokens = imported
    assert cfg.family == SHAPES[VARIANTS[name][0]][0]
    with torch.no_grad():
        expected = theirs(tokens).logits
        diff = (ours(tokens) - expected).abs().max().item()
    bound = logits_bound(SHAPES[VARIANTS[name][0]][1], expected)
    assert diff <= bound, f"{name}: max |logits - transformers'| = {diff:.3g} > {bound:.3g} (rounding)"


@pytest.mark.parametrize(("shape", "scaling"), [("llama3_rope", SHAPES["llama3_rope"][1]["rope_scaling"]),
                                               ("gqa", VARIANTS["linear_rope"][1]["rope_scaling"])])
def test_rope_scaling_changes_the_logits_it_is_checked_on(shape, scaling):
    """The scaled cases would pass vacuously if the scaling did not matter at the tested length: it moves the
    logits by well over the tolerance."""
    scaled = random_hf_model(shape, seed=5, rope_scaling=scaling)
    plain = random_hf_model(shape, seed=5, rope_scaling=None)
    tokens = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = plain(tokens).logits
        assert (scaled(tokens).logits - want).abs().max().item() > 10 * logits_bound(SHAPES[shape][1], want)


@pytest.mark.parity
def test_export_loads_in_transformers_with_every_key(imported, tmp_path):
    """The export's names, rotary layout and config.json (the functions models/hf_folder.py writes with)."""
    from safetensors.torch import save_file

    from trainctl.models.hf import hf_config, to_hf

    name, theirs, cfg, ours, tokens = imported
    state = {n: t for n, t in ours.state_dict().items() if not (cfg.tie_embeddings and n == "output.weight")}
    save_file(dict(to_hf(n, t, cfg) for n, t in state.items()), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hf_config(cfg, torch.float32)))
    back, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert all(not info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), (name, info)
    assert type(back) is type(theirs)
    with torch.no_grad():
        expected = theirs(tokens).logits
        diff = (back.eval()(tokens).logits - expected).abs().max().item()
    bound = logits_bound(SHAPES[VARIANTS[name][0]][1], expected)
    assert diff <= bound, f"{name}: exported logits differ by {diff:.3g} > {bound:.3g} (rounding)"


def test_a_mistral_folder_whose_window_is_shorter_than_the_sequence_is_refused(tmp_path):
    """model=hf reads Mistral's sliding_window; trained past it, trainctl would attend where Mistral does not."""
    from trainctl.config.compose import compose
    from trainctl.config.errors import ConfigError
    from trainctl.config.validate import resolve

    model_type, shape = SHAPES["mistral"]
    hf_folder_config(tmp_path, model_type, {**shape, "sliding_window": 32})
    (tmp_path / "model.safetensors").write_bytes(b"\x02" + bytes(7) + b"{}")
    with pytest.raises(ConfigError) as err:
        resolve(compose(["model=hf", f"model.path={tmp_path}", "data=synthetic", "train.seq_len=64"]))
    assert any(p.startswith("model.sliding_window=32") and "train.seq_len<=32" in p for p in err.value.problems)
    assert resolve(compose(["model=hf", f"model.path={tmp_path}", "data=synthetic",
                            "train.seq_len=32"])).model.sliding_window == 32
