"""The mixture-of-experts families (qwen3_moe, mixtral) against transformers' own classes, in one process (fp32, CPU):
parameter counts of the published models (meta device), logits of imported random weights (per-expert Hub tensors
stacked into GroupedExperts), the export's names and config.json loading back with every key.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.dist.test_families import hf_folder_config
from tests.dist.test_hf import logits_bound

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.dist

# (trainctl model config, model_type, the published config.json's shape keys)
PUBLISHED = {
    "qwen3_30b_a3b": ("qwen3_moe", dict(
        hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
        tie_word_embeddings=False)),
    "mixtral_8x7b": ("mixtral", dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
        max_position_embeddings=32768, rope_theta=1e6, sliding_window=None, rms_norm_eps=1e-5,
        tie_word_embeddings=False)),
}
# Tiny random models: 4 experts, 2 per token; Qwen3-MoE with and without renormalised top-k weights.
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
            max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)
RANDOM = {
    "qwen3_moe": ("qwen3_moe", dict(TINY, head_dim=16, intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                                    num_experts_per_tok=2, norm_topk_prob=True)),
    "qwen3_moe_unnormed": ("qwen3_moe", dict(TINY, head_dim=16, intermediate_size=48, moe_intermediate_size=24,
                                             num_experts=4, num_experts_per_tok=2, norm_topk_prob=False)),
    "mixtral": ("mixtral", dict(TINY, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_counts_equal_transformers(name, tmp_path):
    """The shipped YAML and the same model read from its config.json count what transformers' class holds; the
    active count is the total less the experts a token skips."""
    from trainctl.config.compose import compose
    from trainctl.config.validate import resolve
    from trainctl.models import registry
    from trainctl.plan.flops import param_count

    model_type, shape = PUBLISHED[name]
    config = transformers.AutoConfig.for_model(model_type, **shape)
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(config)
    expected = sum(p.numel() for p in reference.parameters())
    experts = [p for n, p in reference.named_parameters() if ".experts." in n]
    total_experts = config.num_experts if model_type == "qwen3_moe" else config.num_local_experts
    idle = sum(p.numel() for p in experts) * (total_experts - config.num_experts_per_tok) // total_experts
    shipped = compose([f"model={name}", "data=synthetic", "train.seq_len=1024"]).model
    assert param_count(shipped) == expected
    assert registry.spec(shipped.family).active_param_count(shipped) == expected - idle
    folder = hf_folder_config(tmp_path / name, model_type, shape)
    read = resolve(compose(["model=hf", f"model.path={folder}", "data=synthetic", "train.seq_len=1024"])).model
    assert read.family == shipped.family and param_count(read) == expected
    for key in ("num_experts", "experts_per_token", "expert_ffn_dim", "router", "norm_topk_prob"):
        assert getattr(read.moe, key) == getattr(shipped.moe, key), key


def ours_from(folder):
    """The family's model built as the worker builds it, randomly initialized, then loaded from `folder`."""
    from trainctl.config.hf_config import model_fields
    from trainctl.config.schema import ModelConfig, MoEConfig
    from trainctl.models.build import build_model
    from trainctl.models.hf import load_hf_weights

    fields = model_fields(folder)
    cfg = ModelConfig(**{**fields, "moe": MoEConfig(**fields["moe"])})
    model = build_model(cfg, "cpu")
    torch.manual_seed(1)
    model.init_weights()
    assert load_hf_weights(model, folder, cfg) == len(list(model.parameters()))
    return cfg, model.eval()


@pytest.fixture(scope="module", params=list(RANDOM))
def imported(request, tmp_path_factory):
    name = request.param
    model_type, shape = RANDOM[name]
    torch.manual_seed(5)
    theirs = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(model_type, **shape))
    with torch.no_grad():  # transformers zero-inits the router: spread it so the top-k choice matters
        for n, p in theirs.named_parameters():
            if n.endswith(("gate.weight", "experts.gate_up_proj", "experts.down_proj")):
                p.normal_(0, 0.5)
    folder = tmp_path_factory.mktemp(f"moe-{name}")
    theirs.eval().save_pretrained(folder)
    cfg, ours = ours_from(folder)
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
    return name, theirs, cfg, ours, tokens


def _bound(name: str, expected: torch.Tensor) -> float:
    shape = dict(RANDOM[name][1])
    shape["intermediate_size"] = shape.get("moe_intermediate_size", shape["intermediate_size"])
    return logits_bound(shape, expected)


@pytest.mark.parity
def test_imported_logits_equal_transformers_in_one_process(imported):
    name, theirs, cfg, ours, tokens = imported
    assert cfg.family == RANDOM[name][0] and cfg.moe.num_experts == 4
    with torch.no_grad():
        expected = theirs(tokens).logits
        diff = (ours(tokens) - expected).abs().max().item()
    assert diff <= min(1e-4, _bound(name, expected)) * max(1.0, expected.abs().max().item()), (name, diff)


@pytest.mark.parity
def test_export_loads_in_transformers_with_every_key(imported, tmp_path):
    """The export's per-expert names and config.json (what models/hf_folder.py writes with), and verify's view
    of transformers' fused in-memory experts equal to ours."""
    from safetensors.torch import save_file

    from trainctl.models.hf import hf_config, to_hf_items
    from trainctl.models.verify import _compare_tensors, _hub_names

    name, theirs, cfg, ours, tokens = imported
    state = ours.state_dict()
    save_file(dict(item for n, t in state.items() for item in to_hf_items(n, t, cfg)),
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hf_config(cfg, torch.float32)))
    back, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert all(not info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), (name, info)
    assert type(back) is type(theirs)
    assert _compare_tensors(_hub_names(back.state_dict(), cfg), state, cfg) == 0.0
    with torch.no_grad():
        expected = theirs(tokens).logits
        diff = (back.eval()(tokens).logits - expected).abs().max().item()
    assert diff <= _bound(name, expected), (name, diff)
