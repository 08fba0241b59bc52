"""Qwen 2.5, Qwen3 and Mistral checkpoints, against transformers' own classes (fp32, one process).

For each family a small random model of transformers' class is saved by save_pretrained; trainctl reads its
config.json (model=hf's reader) and weights (the worker's loader) and gives its logits within 1e-4. The tensors
and config.json trainctl's export writes (hf.to_hf, hf.hf_config) load back into AutoModelForCausalLM with no
missing or unexpected keys and give the same logits. The published sizes' parameter counts equal transformers'.
"""

from __future__ import annotations

import json

import pytest
import torch

from trainctl.config.hf_config import model_fields
from trainctl.config.schema import ModelConfig
from trainctl.models.hf import hf_config, load_hf_weights, to_hf
from trainctl.models.build import build_model

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

pytestmark = pytest.mark.dist
TOL = 1e-4
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=176,
             vocab_size=300, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0)
# family -> (config class, extra fields): Qwen3 with a head_dim that is not hidden / heads, as Qwen3 0.6B has.
FAMILIES = {
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": False}),
    "mistral": ("MistralConfig", {"sliding_window": None, "tie_word_embeddings": False}),
}


def save_random(folder, family: str):
    cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**SMALL, **extra)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # random norms (q/k norms too), so a misplaced one shows
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0, 0.5)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(20)  # attention sharp enough that a wrong rotary layout shows
    model.save_pretrained(folder)
    return model


def trainctl_model(cfg: ModelConfig, folder):
    torch.manual_seed(1234)
    model = build_model(cfg, "meta")
    model.to_empty(device="cpu")
    model.init_weights()
    assert load_hf_weights(model, folder, cfg) == len(dict(model.named_parameters()))
    return model.eval()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_imported_logits_equal_transformers_and_the_export_loads_back(family, tmp_path):
    hf = save_random(tmp_path / "in", family)
    cfg = ModelConfig(name="hf", **model_fields(tmp_path / "in"))
    assert cfg.family == family
    tokens = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(5))
    ours = trainctl_model(cfg, tmp_path / "in")
    with torch.no_grad():
        expected, got = hf(tokens).logits, ours(tokens)
    assert (got - expected).abs().max().item() <= TOL

    out = tmp_path / "out"
    out.mkdir()
    tensors = dict(to_hf(name, p.detach(), cfg) for name, p in ours.named_parameters())
    safetensors_torch.save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(hf_config(cfg, torch.float32)))
    back, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(back).__name__ == type(hf).__name__
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        assert (back.eval()(tokens).logits - expected).abs().max().item() <= TOL
    assert ModelConfig(name="hf", **model_fields(out)) == cfg


# The published models as trainctl ships them: the plan's count equals transformers' class built on meta.
@pytest.mark.parametrize("name", ["qwen2_5_7b", "qwen2_5_0_5b", "qwen3_8b", "qwen3_0_6b", "mistral_7b"])
def test_plan_count_equals_transformers_built_on_meta(name, tmp_path):
    from trainctl.config.compose import compose
    from trainctl.plan.flops import param_count

    cfg = compose([f"model={name}"]).model
    (tmp_path / "config.json").write_text(json.dumps(hf_config(cfg, torch.bfloat16)))
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(config)
    assert param_count(cfg) == sum(p.numel() for p in reference.parameters())  # tied weights counted once
    # The folder reads back as the same model (the shipped YAML and model=hf agree).
    assert ModelConfig(**{**cfg.__dict__, **model_fields(tmp_path)}) == cfg


def test_a_mistral_window_shorter_than_the_sequence_is_refused(tmp_path):
    from trainctl.config.compose import compose
    from trainctl.config.errors import ConfigError
    from trainctl.config.validate import resolve

    (tmp_path / "config.json").write_text(json.dumps({**SMALL, "model_type": "mistral", "sliding_window": 32}))
    (tmp_path / "model.safetensors").write_bytes(b"\x02" + bytes(7) + b"{}")
    with pytest.raises(ConfigError) as err:
        resolve(compose(["model=hf", f"model.path={tmp_path}", "data=synthetic", "train.seq_len=64"]))
    assert any(p.startswith("model.sliding_window=32") and "train.seq_len<=32" in p for p in err.value.problems)
    resolve(compose(["model=hf", f"model.path={tmp_path}", "data=synthetic", "train.seq_len=32"]))


# Every family through the worker's layouts (tests/dist/hf_layout_worker.py, 2 ranks on gloo).
LAYOUTS = [("qwen2", "ddp"), ("qwen2", "fsdp"), ("qwen2", "tp"), ("qwen3", "fsdp"), ("qwen3", "hsdp"),
           ("qwen3", "tp"), ("mistral", "tp"), ("qwen2", "pp"), ("qwen3", "pp")]  # pp: through the schedule


@pytest.mark.parametrize(("family", "layout"), LAYOUTS)
def test_imported_logits_equal_transformers_in_the_worker_layouts(family, layout, tmp_path):
    from pathlib import Path

    from tests.helpers import run_torchrun

    hf = save_random(tmp_path / "in", family)
    tokens = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(7))
    torch.save(tokens, tmp_path / "tokens.pt")
    worker = str(Path(__file__).with_name("hf_layout_worker.py"))
    proc = run_torchrun(2, worker, str(tmp_path / "in"), layout, str(tmp_path / "tokens.pt"), str(tmp_path / "out.pt"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    with torch.no_grad():
        expected = hf(tokens).logits
    assert (torch.load(tmp_path / "out.pt")["logits"] - expected).abs().max().item() <= TOL


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_hf_to_trainctl_to_hf_round_trip_with_verify(family, tmp_path):
    """A family's folder in (init_from), 3 FSDP2 steps, `export --verify` out: transformers loads it and generates."""
    from tests.dist.test_hf import trainctl

    source = tmp_path / "source"
    save_random(source, family)
    launch = trainctl("launch", "model=hf", f"model.path={source}", f"checkpoint.init_from={source}",
                      "data=synthetic", "sharding=fsdp", "cluster.procs_per_node=2", "train.steps=3",
                      "train.seq_len=32", "train.global_batch=4", "train.micro_batch=2", "train.eval_every=0",
                      "schedule.warmup_steps=1", "logging.progress=false", "--name", "rt", cwd=tmp_path)
    assert launch.returncode == 0, launch.stdout[-3000:] + launch.stderr[-3000:]
    out = tmp_path / "exported"
    exported = trainctl("export", "rt", "--out", str(out), "--verify", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr[-3000:]
    cls = FAMILIES[family][0].replace("Config", "ForCausalLM")
    assert f"verified: transformers loads it as {cls}" in exported.stdout
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    tokens = torch.tensor([[1, 2, 3, 4, 5]])
    assert model.generate(tokens, max_new_tokens=6, do_sample=False, pad_token_id=0).shape == (1, 11)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_two_pipeline_stages_load_their_pieces_and_give_transformers_logits(family, tmp_path):
    """Each stage of a 2-stage split (the worker's build_stage_model) loads only its pieces from the folder."""
    from trainctl.train.pipeline import build_stage_model

    hf = save_random(tmp_path / "in", family)
    cfg = ModelConfig(name="hf", **model_fields(tmp_path / "in"))
    tokens = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(9))
    stages = []
    for layers, first, last in ((range(0, 1), True, False), (range(1, 2), False, True)):
        part = build_stage_model(cfg, layers, first=first, last=last).to_empty(device="cpu")
        part.init_weights()
        assert load_hf_weights(torch.nn.ModuleList([part]), tmp_path / "in", cfg) == len(list(part.parameters()))
        stages.append(part.eval())
    with torch.no_grad():
        assert (stages[1](stages[0](tokens)) - hf(tokens).logits).abs().max().item() <= TOL
