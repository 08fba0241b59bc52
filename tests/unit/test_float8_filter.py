"""precision.fp8_filter: float8 converts only the Linears torchao's size rule says gain (issue 31, item 4).

torchao float8 runs on CPU: the conversions below are real, on meta-device models.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from trainctl.config.compose import compose
from trainctl.config.errors import ConfigError
from trainctl.config.schema import ModelConfig, PrecisionConfig
from trainctl.config.validate import resolve
from trainctl.core import float8 as rule
from trainctl.models.build import build_model
from trainctl.plan.flops import fp8_matmul_params
from trainctl.train.parallel.float8 import apply_float8, is_float8_linear

float8 = pytest.importorskip("torchao.float8")

# Llama 3.2 1B's block widths with one layer and a small vocabulary (the output is excluded by name anyway).
WIDE = ModelConfig(name="w", dim=2048, n_layers=1, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=256,
                   max_seq_len=64)
SIZES = (16, 512, 1024, 1040, 2048, 2064, 4096, 4112, 8192)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_cores_rule_is_torchaos_own(recipe):
    """The plan's torch-free copy (core/float8.gains) answers as torchao's _auto_filter_for_recipe on every shape."""
    auto = getattr(float8, "_auto_filter_for_recipe", None)
    if auto is None:
        pytest.skip("this torchao has no _auto_filter_for_recipe")
    theirs = auto(recipe, ["output"])
    for n, k in itertools.product(SIZES, SIZES):
        linear = nn.Linear(k, n, bias=False, device="meta")
        assert theirs(linear, "layers.0.x") == rule.converts("auto", recipe, "layers.0.x", n, k, ["output"]), (n, k)
        assert not theirs(linear, "output")


@pytest.mark.parametrize(("recipe", "fp8_filter", "converted"), [
    ("tensorwise", "auto", {"wq", "wo", "w1", "w2", "w3"}),  # wk, wv: 512 outputs from 2048 inputs do not gain
    ("rowwise", "auto", {"w1", "w3"}),  # rowwise needs more than 2048 outputs (and 4096 from 2048 inputs)
    ("rowwise_with_gw_hp", "auto", {"w1", "w3"}),  # torchao's rule leaves it out: rowwise's thresholds
    ("tensorwise", "all", {"wq", "wk", "wv", "wo", "w1", "w2", "w3"}),
])
def test_the_worker_converts_what_the_plan_counts(recipe, fp8_filter, converted):
    model = build_model(WIDE, "meta")
    precision = PrecisionConfig(compute_dtype="bf16", fp8=True, fp8_recipe=recipe, fp8_filter=fp8_filter)
    apply_float8(model, precision, fsdp=False)
    names = {fqn.rsplit(".", 1)[-1] for fqn, m in model.named_modules() if is_float8_linear(m)}
    assert names == converted
    weights = sum(m.weight.numel() for m in model.modules() if is_float8_linear(m))
    assert weights == fp8_matmul_params(WIDE, precision.fp8_exclude, fp8_filter, recipe)


@pytest.mark.parametrize(("recipe", "emulated"), [("rowwise", True), ("rowwise_with_gw_hp", True),
                                                  ("tensorwise", False)])
def test_rowwise_recipes_make_inductor_emulate_the_casts(recipe, emulated):
    import torch._inductor.config as inductor_config

    with inductor_config.patch(emulate_precision_casts=False):  # restored on exit
        precision = PrecisionConfig(compute_dtype="bf16", fp8=True, fp8_recipe=recipe, fp8_filter="all")
        apply_float8(build_model(WIDE, "meta"), precision, fsdp=False)
        assert inductor_config.emulate_precision_casts is emulated


def test_rowwise_with_gw_hp_trains_a_step_on_cpu():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 128, bias=False), nn.SiLU(), nn.Linear(128, 64, bias=False)).bfloat16()
    precision = PrecisionConfig(compute_dtype="bf16", fp8=True, fp8_recipe="rowwise_with_gw_hp", fp8_filter="all")
    assert apply_float8(mlp, precision, fsdp=False) == 2
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    mlp(x).float().square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in mlp.parameters())


def test_the_keys_compose_and_a_wrong_filter_is_one_line():
    cfg = compose(["recipe=llama1b_bench", "precision=fp8", "precision.fp8_recipe=rowwise_with_gw_hp"])
    assert cfg.precision.fp8_filter == "auto" and cfg.precision.fp8_recipe == "rowwise_with_gw_hp"
    with pytest.raises(ConfigError, match="precision.fp8_filter") as caught:
        resolve(compose(["recipe=llama1b_bench", "precision=fp8", "precision.fp8_filter=some"]))
    assert "auto" in str(caught.value) and "all" in str(caught.value)


def test_the_plan_counts_no_autocast_copy_of_a_converted_weight():
    """torchao's Float8Linear casts the fp32 weight to float8 itself: autocast makes no bf16 copy to keep."""
    from trainctl.plan.runplan import build

    def casts(*more: str) -> int:
        return build(resolve(compose(["recipe=llama1b_bench", "train.compile=false", *more]))).memory.weight_casts

    bf16 = casts()
    m = compose(["recipe=llama1b_bench"]).model
    kv = m.n_kv_heads * (m.dim // m.n_heads)
    assert casts("precision=fp8", "precision.fp8_filter=all") == 0  # every block Linear converted; the head chunks
    # auto (tensorwise): wk and wv do not gain at this width: their bf16 copies stay.
    assert casts("precision=fp8") == 2 * 2 * kv * m.dim * m.n_layers < bf16
