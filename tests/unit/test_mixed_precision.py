"""Loss scaling and float8 conversion, in one process (no process group needed)."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from tests.faults import worker_faults
from trainctl.config.schema import ModelConfig, PrecisionConfig
from trainctl.models.build import build_model
from trainctl.models.loss_head import OutputHead
from trainctl.train.errors import WorkerConfigError
from trainctl.train.loop.loss_scaling import DynamicLossScaler, NoLossScaling, build_loss_scaler
from trainctl.train.parallel.float8 import apply_float8, count_float8_linears, wants_float8

FP16 = PrecisionConfig(compute_dtype="fp16", loss_scaling=True, init_scale=1024.0)
# dim 64, kv heads 2 x 16, ffn 96: every block Linear is 16-aligned.
SMALL = ModelConfig(name="t", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=256, max_seq_len=32)
LINEARS_PER_BLOCK = 7  # wq wk wv wo w1 w2 w3


def one_step(scaler, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float = 0.0,
             step: int = 0, on_loss=None) -> float:
    """The loop's order: scaled backward, unscale, norm (clip), step; returns the unscaled grad norm.

    on_loss: the worker's hook (hooks.py), called with `step` on the loss as the loop's TokenLoss calls it.
    """
    loss = model(torch.ones(4, 8)).square().mean()
    if on_loss is not None:
        loss = on_loss(step, loss)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    params = list(model.parameters())
    if max_norm:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    scaler.step(optimizer)
    optimizer.zero_grad(set_to_none=True)
    return float(norm)


def linear_and_sgd() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_without_loss_scaling_the_scaler_is_a_no_op():
    assert isinstance(build_loss_scaler(PrecisionConfig(), torch.device("cpu")), NoLossScaling)


@pytest.mark.parity
def test_unscaled_gradients_match_plain_fp32_backward():
    plain_model, plain_opt = linear_and_sgd()
    plain_norm = one_step(NoLossScaling(), plain_model, plain_opt)
    scaled_model, scaled_opt = linear_and_sgd()
    scaler = build_loss_scaler(FP16, torch.device("cpu"))
    scaled_norm = one_step(scaler, scaled_model, scaled_opt)
    # The clipping code sees the true norm, not 1024 times it; the update is the same. Exactly: scaling by a
    # power of two and back changes no fp32 rounding (no value here comes near overflow or underflow).
    assert scaled_norm == plain_norm
    assert torch.equal(scaled_model.weight, plain_model.weight)
    assert scaler.metrics() == {"loss_scale": 1024.0, "skipped_steps": 0}


def test_injected_overflow_skips_the_step_and_halves_the_scale():
    on_loss = worker_faults.hooks_of({"inf_at_step": 1}).on_loss  # the test-side fault (tests/faults)
    scaler = build_loss_scaler(FP16, torch.device("cpu"))
    assert isinstance(scaler, DynamicLossScaler)
    model, optimizer = linear_and_sgd()
    one_step(scaler, model, optimizer, max_norm=1.0, step=0, on_loss=on_loss)
    before = model.weight.detach().clone()
    norm = one_step(scaler, model, optimizer, max_norm=1.0, step=1, on_loss=on_loss)
    assert not torch.isfinite(torch.tensor(norm))
    assert torch.equal(model.weight.detach(), before), "an overflowed step must leave the weights unchanged"
    assert scaler.metrics() == {"loss_scale": 512.0, "skipped_steps": 1}
    one_step(scaler, model, optimizer, max_norm=1.0, step=2, on_loss=on_loss)
    assert not torch.equal(model.weight.detach(), before), "training continues after the skipped step"
    assert scaler.metrics() == {"loss_scale": 512.0, "skipped_steps": 1}


def test_the_overflow_fault_keeps_the_forward_loss_true():
    """inf_at_step overflows the gradient only: the loss the loop reports is the true one."""
    on_loss = worker_faults.hooks_of({"inf_at_step": 0}).on_loss
    weight = torch.ones(3, requires_grad=True)
    loss = on_loss(0, (weight * 2).sum())
    assert loss.item() == 6.0
    loss.backward()
    assert torch.isinf(weight.grad).all()


def test_state_dict_round_trip_keeps_scale_and_skips():
    scaler = build_loss_scaler(FP16, torch.device("cpu"))
    one_step(scaler, *linear_and_sgd(), step=0, on_loss=worker_faults.hooks_of({"inf_at_step": 0}).on_loss)
    restored = build_loss_scaler(FP16, torch.device("cpu"))
    restored.load_state_dict(scaler.state_dict())
    assert restored.metrics() == {"loss_scale": 512.0, "skipped_steps": 1}


@pytest.mark.parametrize(("fqn", "shape", "wanted"), [
    ("layers.0.attention.wq", (64, 64), True),
    ("output", (64, 256), False),  # excluded by name
    ("layers.0.feed_forward.w1", (64, 40), False),  # 40 is not a multiple of 16
    ("layers.0.feed_forward.w2", (40, 64), False),
])
def test_float8_filter(fqn, shape, wanted):
    every = PrecisionConfig(compute_dtype="bf16", fp8=True, fp8_exclude=["output"], fp8_filter="all")
    assert wants_float8(nn.Linear(*shape, device="meta"), fqn, every) is wanted


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_converts_every_eligible_linear_of_the_meta_model(recipe):
    model = build_model(SMALL, "meta")
    precision = PrecisionConfig(compute_dtype="bf16", fp8=True, fp8_recipe=recipe, fp8_exclude=["output", "w2"],
                                fp8_filter="all")
    converted = apply_float8(model, precision, fsdp=False)
    # w2 of every block and the output layer are excluded by name.
    assert converted == count_float8_linears(model) == (LINEARS_PER_BLOCK - 1) * SMALL.n_layers
    # Excluded Linears keep their class (the output head's own, which chunks the loss).
    assert type(model.output) is OutputHead and type(model.layers["0"].feed_forward.w2) is nn.Linear


def test_float8_off_converts_nothing():
    model = build_model(SMALL, "meta")
    assert apply_float8(model, PrecisionConfig(), fsdp=True) == 0 and count_float8_linears(model) == 0


def test_missing_torchao_is_one_line_naming_the_key_and_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # makes `import torchao.float8` raise ImportError
    with pytest.raises(WorkerConfigError, match=r"precision.fp8=true needs torchao: pip install 'trainctl\[fp8\]'"):
        apply_float8(build_model(SMALL, "meta"), PrecisionConfig(compute_dtype="bf16", fp8=True), fsdp=False)


def test_every_precision_runs_with_tensor_parallel():
    from trainctl.config.schema import ShardingConfig
    from trainctl.core.support import unsupported

    fp8 = PrecisionConfig(compute_dtype="bf16", fp8=True)
    assert unsupported(ShardingConfig(), fp8) == unsupported(ShardingConfig(), FP16) == []
    assert unsupported(ShardingConfig(tp=2), fp8) == []


@pytest.mark.parametrize("exclude", [["output"], ["output", "w2"]])
def test_tensor_parallel_uses_float8_styles_only_where_every_linear_is_float8(exclude):
    """torchao's float8 TP styles cast a sub-layer's input to float8: all its Linears must be Float8Linear."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    from trainctl.models.common.parallel import block_plan

    model = build_model(SMALL, "meta")
    precision = PrecisionConfig(compute_dtype="bf16", fp8=True, fp8_exclude=exclude, fp8_filter="all")
    apply_float8(model, precision, fsdp=False)
    plan = block_plan(model.layers["0"], float8_tensorwise=True)
    assert type(plan["attention.wq"]) is Float8ColwiseParallel
    assert type(plan["attention.wo"]) is Float8RowwiseParallel
    mlp_float8 = "w2" not in exclude
    assert (type(plan["feed_forward.w1"]) is Float8ColwiseParallel) == mlp_float8
    assert type(plan["feed_forward.w2"]) is (Float8RowwiseParallel if mlp_float8 else RowwiseParallel)
    # Without the tensorwise recipe (or off CUDA) the plain styles shard the Float8Linear as is.
    plain = block_plan(model.layers["0"], float8_tensorwise=False)
    assert type(plain["attention.wq"]) is ColwiseParallel
