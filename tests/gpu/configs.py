"""The configs the CUDA tests train, built by plain functions that tests/unit/test_gpu_configs.py runs on CPU.

Every config a GPU test uses comes from a builder here, so a wrong argument (a TypeError) or an invalid value fails
the unit tier instead of waiting for a GPU.
"""

from __future__ import annotations

from dataclasses import replace

from tests.dist.worker_runs import base_config
from trainctl.config.schema import (
    CheckpointConfig,
    ModelConfig,
    PrecisionConfig,
    RunConfig,
    ScheduleConfig,
    ShardingConfig,
)
from trainctl.core.dims import ParallelDims
from trainctl.plan import memory as plan_memory
from trainctl.plan.stages import rank_stages

# Large enough that matmuls dominate and fp8 applies (every Linear 16-aligned), small enough for seconds per run.
MODEL = ModelConfig(name="gpu-test", dim=512, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=1408, vocab_size=256,
                    max_seq_len=512)
STEPS = 30
BF16 = PrecisionConfig(compute_dtype="bf16")

# name: (precision, compile, max relative loss difference from fp32 at any step). bf16 and fp16 round each
# element to 2^-8 and 2^-11; a per-step bound of 2% is a few units of bf16 rounding summed over 30 steps.
CLOSE_TO_FP32 = {
    "bf16": (BF16, False, 0.02),
    "bf16_compile": (BF16, True, 0.02),
    "fp16": (PrecisionConfig(compute_dtype="fp16", loss_scaling=True), False, 0.02),
}

# fp8 against bf16 (the precision it replaces), on the mean loss of the last LAST_STEPS steps. A single step's loss
# is noisy under fp8 (up to 5.6% from fp32 measured on an NVIDIA H200); the mean over 10 steps is not. e4m3 keeps 3
# mantissa bits: each matmul operand is rounded to a relative 2^-4. The training-loss means must agree within that
# one unit of e4m3 rounding (2^-4 = 6.25%): a recipe that scaled wrongly or stopped learning moves them by far more.
LAST_STEPS = 10
FP8_TOLERANCE = 2.0**-4
CLOSE_TO_BF16 = {
    # name: (precision, compile)
    # fp8_filter=all: every Linear of this small model in float8 (auto would keep most of them bf16 at dim 512)
    "fp8_tensorwise": (replace(BF16, fp8=True, fp8_recipe="tensorwise", fp8_filter="all"), False),
    "fp8_rowwise": (replace(BF16, fp8=True, fp8_recipe="rowwise", fp8_filter="all"), False),
    "fp8_tensorwise_compile": (replace(BF16, fp8=True, fp8_recipe="tensorwise", fp8_filter="all"), True),
}

MEMORY_CASES = [(mode, micro) for mode in ("none", "selective", "full") for micro in (2, 8)]


def gpu_config(cache, name: str, precision: PrecisionConfig = PrecisionConfig(), compile_: bool = False,
               **train) -> RunConfig:
    """One CUDA process training MODEL; `train` overrides TrainConfig fields (steps, seq_len, batch, ...)."""
    fields = {"steps": STEPS, "seq_len": 256, "global_batch": 8, "micro_batch": 8, "compile": compile_, **train}
    cfg = base_config(cache, **fields)
    return replace(cfg, name=name, model=MODEL, precision=precision, sharding=ShardingConfig(strategy="none"),
                   cluster=replace(cfg.cluster, device="cuda"))


def resume_config(cache) -> RunConfig:
    """20 bf16 steps at a constant learning rate without checkpoints (the test adds the step-10 one)."""
    cfg = gpu_config(cache, "whole", BF16, steps=20)
    return replace(cfg, schedule=ScheduleConfig(name="constant", warmup_steps=0),
                   checkpoint=CheckpointConfig(every=0, save_final=False))


def resume_split_config(whole: RunConfig) -> RunConfig:
    """The first half of `whole`, saving at step 10."""
    return replace(whole, name="split", train=replace(whole.train, steps=10), checkpoint=CheckpointConfig(every=10))


def memory_config(cache, mode: str, micro_batch: int) -> RunConfig:
    """4 bf16 steps of micro_batch x 512 tokens under activation_checkpointing=mode."""
    return gpu_config(cache, f"mem-{mode}-{micro_batch}", BF16, steps=4, global_batch=micro_batch,
                      micro_batch=micro_batch, seq_len=512, activation_checkpointing=mode)


def syncs_config(cache) -> RunConfig:
    return gpu_config(cache, "syncs", BF16, steps=8)


def planned_memory(cfg: RunConfig) -> plan_memory.RankMemory:
    """The plan's per-rank memory for one process of `cfg`."""
    (stage,) = rank_stages(cfg.model, cfg.sharding, cfg.train.grad_accum)
    return plan_memory.estimate(cfg.model, cfg.precision, cfg.sharding, cfg.train, ParallelDims(), stage)


def every_config(cache) -> dict[str, RunConfig]:
    """Every config the CUDA tests train, by a readable name."""
    configs = {"fp32": gpu_config(cache, "fp32")}
    for name, (precision, compile_, _) in CLOSE_TO_FP32.items():
        configs[name] = gpu_config(cache, name, precision, compile_)
    for name, (precision, compile_) in CLOSE_TO_BF16.items():
        configs[name] = gpu_config(cache, name, precision, compile_)
    configs["resume"] = resume_config(cache)
    configs["resume_split"] = resume_split_config(configs["resume"])
    for mode, micro in MEMORY_CASES:
        configs[f"memory-{mode}-{micro}"] = memory_config(cache, mode, micro)
    configs["syncs"] = syncs_config(cache)
    return configs
