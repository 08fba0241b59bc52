"""bf16, fp16 (dynamic loss scaling) and fp8 (torchao) runs against the fp32 loss curve.

Tolerances, measured on CPU (torch 2.13, torchao 0.18) for this tiny model over 20 steps,
as the largest relative difference of a logged loss from the fp32 run's:
  bf16 (FSDP2 policy) 4.9e-4, fp16 (autocast, no overflow) 2.2e-5, fp8 tensorwise (FSDP2) 1.7e-3.
We allow 1e-2 for bf16/fp16 and 2e-2 for fp8: 10-20x margin for other torch versions and
kernels, yet well below what a broken path gives (a skipped or wrong update moves the
curve by several percent within a few steps). Each run must also differ from fp32 by more
than 1e-6, ten times fp32's own reduction-order noise (~1e-7 across strategies): otherwise
it did not run in reduced precision.

fp16 starts at init_scale 1024, where this model never overflows by itself, so the one
skipped step of the overflow test is the injected one (the test-side fault inf_at_step).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from worker_runs import TINY, base_config, records, series, train_many

from tests.faults.worker_faults import fault_env
from trainctl.config.schema import PrecisionConfig, ShardingConfig

pytestmark = pytest.mark.dist

STEPS = 20
INJECT_STEP = 9  # 0-based optimizer step; its metrics are logged at step INJECT_STEP + 1
FSDP2 = ShardingConfig(strategy="fsdp", dp_shard=2)
BF16 = PrecisionConfig(compute_dtype="bf16")
FP16 = PrecisionConfig(compute_dtype="fp16", loss_scaling=True, init_scale=1024.0)
FP8 = PrecisionConfig(compute_dtype="bf16", fp8=True, fp8_recipe="tensorwise", fp8_filter="all")  # tiny Linears
TP2 = ShardingConfig(strategy="none", tp=2)
TOLERANCE = {"bf16": 1e-2, "fp16": 1e-2, "fp8": 2e-2, "fp8_tp": 2e-2}
FP32_NOISE = 1e-6


def tiny(cache, name: str, precision: PrecisionConfig, sharding: ShardingConfig = ShardingConfig(), nproc: int = 1,
         **train):
    """dim 64, 2 layers, seq 32, global batch 4: reduced-precision matmuls are slow on CPU."""
    train = {"micro_batch": 4 // nproc, **train}
    cfg = base_config(cache, steps=STEPS, seq_len=32, global_batch=4, **train)
    return replace(cfg, name=name, precision=precision, sharding=sharding)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("precision")


@pytest.fixture(scope="module")
def clean(root, data_cache):
    """fp32 and every reduced-precision run without an injected fault: the single-process ones in one process,
    the 2-rank ones in one torchrun. Each run builds its own model, float8 swap (tensorwise: no global Inductor
    flag) and scaler, and is seeded on its own, so sharing the process changes none of its numbers."""
    cases = {
        "fp32": (tiny(data_cache, "fp32", PrecisionConfig()), None),
        # bf16 through FSDP2's mixed-precision policy, fp16 through autocast + GradScaler, fp8 under FSDP2.
        "bf16-fsdp": (tiny(data_cache, "bf16-fsdp", BF16, FSDP2, nproc=2), 2),
        "fp16-single": (tiny(data_cache, "fp16-single", FP16), None),
        "fp8-fsdp": (tiny(data_cache, "fp8-fsdp", FP8, FSDP2, nproc=2), 2),
        # Float8Linear sharded by tensor parallelism (2 ranks, dp 1: each sees the whole batch of 4).
        "fp8-tp": (replace(tiny(data_cache, "fp8-tp", FP8), sharding=TP2), 2),
    }
    return train_many(root, cases)


@pytest.fixture(scope="module")
def fp32(clean):
    return clean["fp32"]


@pytest.fixture(scope="module")
def runs(clean):
    return {"bf16": clean["bf16-fsdp"], "fp16": clean["fp16-single"], "fp8": clean["fp8-fsdp"],
            "fp8_tp": clean["fp8-tp"]}


PP2 = ShardingConfig(strategy="none", pp=2, pp_schedule="1f1b")


@pytest.fixture(scope="module")
def overflowed(root, data_cache):
    """The two runs with inf injected at one step (one torchrun, the same fault environment): fp16 over 2 pipeline
    stages (the schedule's loss function applies the scale), and fp16 under FSDP2 (ShardedGradScaler) evaluated
    after every step."""
    cases = {
        "fp16-pp": (replace(tiny(data_cache, "fp16-pp", FP16, micro_batch=2, grad_accum=2), sharding=PP2), 2),
        "fp16-fsdp-inf": (tiny(data_cache, "fp16-fsdp-inf", FP16, FSDP2, nproc=2, eval_every=1, eval_batches=1), 2),
    }
    with pytest.MonkeyPatch.context() as env:
        for name, value in fault_env(inf_at_step=INJECT_STEP).items():
            env.setenv(name, value)
        return train_many(root, cases)


@pytest.fixture(scope="module")
def fp16_pipeline(overflowed):
    return overflowed["fp16-pp"]


def test_fp16_pipeline_tracks_fp32_and_skips_the_injected_overflow(fp32, fp16_pipeline):
    skipped = series(fp16_pipeline, "skipped_steps")
    assert skipped == [0] * INJECT_STEP + [1] * (STEPS - INJECT_STEP)  # both stages skipped that step
    losses, reference = series(fp16_pipeline, "loss"), series(fp32, "loss")
    # Up to the skipped step the curve is fp32's within fp16 tolerance; after it, training goes on.
    assert max_relative_difference(losses[:INJECT_STEP] + reference[INJECT_STEP:], reference) <= TOLERANCE["fp16"]
    assert decreases(losses)


@pytest.fixture(scope="module")
def injected(overflowed):
    return overflowed["fp16-fsdp-inf"]


def max_relative_difference(values: list[float], reference: list[float]) -> float:
    assert len(values) == len(reference) == STEPS
    return max(abs(v - r) / abs(r) for v, r in zip(values, reference, strict=True))


def decreases(losses: list[float]) -> bool:
    return sum(losses[-5:]) / 5 < 0.95 * sum(losses[:5]) / 5


@pytest.mark.parametrize("kind", ["bf16", "fp16", "fp8", "fp8_tp"])
def test_reduced_precision_tracks_fp32(fp32, runs, kind):
    difference = max_relative_difference(series(runs[kind], "loss"), series(fp32, "loss"))
    assert FP32_NOISE < difference <= TOLERANCE[kind], difference


@pytest.mark.parametrize("kind", ["bf16", "fp16", "fp8", "fp8_tp"])
def test_reduced_precision_loss_decreases(runs, kind):
    assert decreases(series(runs[kind], "loss"))


def test_fp16_without_overflow_skips_nothing_and_logs_the_scale(runs):
    assert series(runs["fp16"], "skipped_steps") == [0] * STEPS
    assert series(runs["fp16"], "loss_scale") == [FP16.init_scale] * STEPS


def test_bf16_logs_no_loss_scale(runs):
    assert "loss_scale" not in records(runs["bf16"], "train")[0]


def test_fp8_converts_every_block_linear_but_the_output(runs):
    log = (runs["fp8"] / "logs" / "rank0.log").read_text()
    linears = 7 * TINY.n_layers  # wq wk wv wo w1 w2 w3, all 16-aligned in TINY
    expected = (f"float8: {linears} of {linears + 1} Linear layers converted "
                "(recipe tensorwise, filter all, fsdp float8 all-gather True)")
    assert expected in log


def test_fp8_over_tensor_parallel_converts_before_sharding(runs):
    # Converted on the full-size meta model, then each Float8Linear is sharded by TP.
    for rank in (0, 1):
        log = (runs["fp8_tp"] / "logs" / f"rank{rank}.log").read_text()
        assert f"float8: {7 * TINY.n_layers} of {7 * TINY.n_layers + 1} Linear layers converted" in log
        assert "tensor parallel x2" in log


def test_injected_overflow_skips_exactly_that_step(injected):
    skipped, scale = series(injected, "skipped_steps"), series(injected, "loss_scale")
    logged = INJECT_STEP + 1
    assert skipped == [0] * INJECT_STEP + [1] * (STEPS - INJECT_STEP)
    assert scale[logged - 1] == scale[logged - 2] / 2 == FP16.init_scale / 2
    assert not math.isfinite(series(injected, "grad_norm")[logged - 1])
    # The reported loss is the true one; the loss fed to backward was inf.
    assert all(math.isfinite(loss) for loss in series(injected, "loss"))


def test_injected_overflow_leaves_weights_unchanged_and_training_goes_on(injected):
    val = {r["step"]: r["val_loss"] for r in records(injected, "eval")}
    # Deterministic eval on the same weights gives the same number: before and after the skipped step.
    assert val[INJECT_STEP + 1] == val[INJECT_STEP]
    assert val[INJECT_STEP + 2] != val[INJECT_STEP + 1]
    assert val[STEPS] < val[0]
    assert decreases(series(injected, "loss"))
