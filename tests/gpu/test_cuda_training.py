"""What only a CUDA device can show: `pytest -m gpu` on a lent GPU (scripts/gpu_proof.sh tests). Skipped elsewhere.

- bf16, fp16, fp8 (tensorwise, rowwise) and compiled bf16 loss curves against an fp32 run of the same model,
  data and init over 30 steps; the tolerances are stated per precision below.
- resume on CUDA gives the uninterrupted run's losses bitwise (when the uninterrupted run itself is
  reproducible on this device: run twice first).
- the plan's per-rank peak against torch.cuda.max_memory_allocated within 10%, across checkpointing modes and
  micro-batch sizes.
- SDPA runs cuDNN or flash attention kernels (profiler kernel names), not the math fallback.
- one host sync per training step (the guard's agreed all-reduce), counted by CUDA's sync debug mode.
The configs are checked on CPU too (`test_the_gpu_configs_resolve`), so this file cannot rot unnoticed.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch

from tests.dist.worker_runs import base_config, records, run_worker, series, to_yaml, train_and_check
from trainctl.config.schema import CheckpointConfig, ModelConfig, PrecisionConfig, ScheduleConfig, ShardingConfig
from trainctl.config.validate import resolve
from trainctl.core.dims import ParallelDims
from trainctl.plan import memory as plan_memory
from trainctl.plan.stages import rank_stages

CUDA = torch.cuda.is_available()

# Large enough that matmuls dominate and fp8 applies (every Linear 16-aligned), small enough for seconds per run.
MODEL = ModelConfig(name="gpu-test", dim=512, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=1408, vocab_size=256,
                    max_seq_len=512)
STEPS = 30
PRECISIONS = {
    # name: (precision, compile, max relative loss difference from fp32 at any step)
    "bf16": (PrecisionConfig(compute_dtype="bf16"), False, 0.02),
    "bf16_compile": (PrecisionConfig(compute_dtype="bf16"), True, 0.02),
    "fp16": (PrecisionConfig(compute_dtype="fp16", loss_scaling=True), False, 0.02),
    "fp8_tensorwise": (PrecisionConfig(compute_dtype="bf16", fp8=True, fp8_recipe="tensorwise"), False, 0.04),
    "fp8_rowwise": (PrecisionConfig(compute_dtype="bf16", fp8=True, fp8_recipe="rowwise"), False, 0.04),
}


def gpu_config(cache, name: str, precision=PrecisionConfig(), compile_=False, **train):
    cfg = base_config(cache, steps=STEPS, seq_len=256, global_batch=8, micro_batch=8, compile=compile_, **train)
    return replace(cfg, name=name, model=MODEL, precision=precision, sharding=ShardingConfig(strategy="none"),
                   cluster=replace(cfg.cluster, device="cuda"))


@pytest.mark.unit
def test_the_gpu_configs_resolve(data_cache):
    # Runs everywhere: the configs below are valid for the worker (on CPU the device check is the launcher's).
    for name, (precision, compile_, _) in PRECISIONS.items():
        resolve(replace(gpu_config(data_cache, name, precision, compile_), cluster=replace(
            gpu_config(data_cache, name).cluster, device="cpu")))


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory, data_cache):
    return train_and_check(tmp_path_factory.mktemp("fp32"), gpu_config(data_cache, "fp32"), None)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(PRECISIONS))
def test_lower_precision_follows_the_fp32_loss_curve(tmp_path, data_cache, fp32_run, name):
    precision, compile_, tolerance = PRECISIONS[name]
    run = train_and_check(tmp_path, gpu_config(data_cache, name, precision, compile_), None)
    got, want = series(run, "loss"), series(fp32_run, "loss")
    assert len(got) == len(want) == STEPS
    worst = max(abs(g - w) / w for g, w in zip(got, want, strict=True))
    assert worst <= tolerance, f"{name}: worst relative loss difference {worst:.4f} > {tolerance}"
    assert got[-1] < got[0] * 0.9  # and it trains


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_resume_on_cuda_is_bitwise(tmp_path, data_cache):
    constant = ScheduleConfig(name="constant", warmup_steps=0)
    no_save = CheckpointConfig(every=0, save_final=False)
    cfg = replace(gpu_config(data_cache, "whole", PrecisionConfig(compute_dtype="bf16"), steps=20),
                  schedule=constant, checkpoint=no_save)
    whole = series(train_and_check(tmp_path / "a", cfg, None), "loss")
    again = series(train_and_check(tmp_path / "b", cfg, None), "loss")
    if whole != again:
        pytest.skip(f"this device is not run-to-run reproducible (max diff "
                    f"{max(abs(x - y) for x, y in zip(whole, again, strict=True)):.2e}): bitwise resume is moot")
    first = replace(cfg, name="split", train=replace(cfg.train, steps=10), checkpoint=CheckpointConfig(every=10))
    run_dir = train_and_check(tmp_path / "c", first, None)
    # The same run directory asked for 20 steps: it resumes from its step-10 checkpoint.
    (run_dir / "config.yaml").write_text(to_yaml(replace(first, train=replace(first.train, steps=20))))
    proc = run_worker(run_dir, None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = [r["loss"] for r in records(run_dir, "train")]
    assert resumed[-10:] == whole[-10:]


MEMORY_CASES = [(mode, micro) for mode in ("none", "selective", "full") for micro in (2, 8)]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("mode, micro_batch", MEMORY_CASES)
def test_the_plans_peak_matches_max_memory_allocated(tmp_path, data_cache, mode, micro_batch):
    precision = PrecisionConfig(compute_dtype="bf16")
    cfg = gpu_config(data_cache, f"mem-{mode}-{micro_batch}", precision, steps=4, global_batch=micro_batch,
                     micro_batch=micro_batch, seq_len=512, activation_checkpointing=mode)
    run = train_and_check(tmp_path, cfg, None)
    (record,) = records(run, "memory")
    assert record["peak_source"] == "cuda_max_memory_allocated"
    (stage,) = rank_stages(cfg.model, cfg.sharding, cfg.train.grad_accum)
    planned = plan_memory.estimate(cfg.model, precision, cfg.sharding, cfg.train, ParallelDims(), stage).peak
    assert record["peak_bytes"] == pytest.approx(planned, rel=0.10), (mode, micro_batch)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("first", ["cudnn", "flash"])
@pytest.mark.parametrize("n_kv_heads", [4, 8])
def test_attention_runs_the_kernel_the_plan_predicts(first, n_kv_heads):
    from torch.profiler import ProfilerActivity, profile

    from trainctl.config.schema import ClusterConfig, RunConfig, TrainConfig
    from trainctl.models.build import build_model
    from trainctl.models.common.attention import attention_backends
    from trainctl.plan.attention_kernel import predicted_kernel

    model_cfg = replace(MODEL, n_kv_heads=n_kv_heads)
    torch.manual_seed(0)
    model = build_model(model_cfg, "cuda").to(torch.bfloat16)
    model.init_weights()
    attention = model.layers["0"].attention
    x = torch.randn(4, 512, MODEL.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with attention_backends(first), profile(activities=[ProfilerActivity.CUDA]) as prof:
        attention(x, model.freqs).sum().backward()
        torch.cuda.synchronize()
    kernels = {e.name.lower() for e in prof.events() if e.device_type.name == "CUDA"}
    ran = [name for name in ("cudnn", "flash") if any(name in k for k in kernels)]
    cfg = RunConfig(model=model_cfg, precision=PrecisionConfig(compute_dtype="bf16"),
                    train=replace(TrainConfig(), attention=first), cluster=replace(ClusterConfig(), device="cuda"))
    predicted = predicted_kernel(cfg)[0].split(" or ")
    print(f"attention first={first} n_kv_heads={n_kv_heads}: ran {ran}, plan predicted {predicted}")
    assert ran and ran[0] in predicted, sorted(kernels)[:40]
    if first == "flash":
        assert "cudnn" not in ran


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_one_host_sync_per_training_step(tmp_path, data_cache, monkeypatch):
    from trainctl.train.loop.step import train_step
    from trainctl.train.loop.stop import StopRequest
    from trainctl.train.loop.trainer import setup
    from trainctl.train.parallel import distributed

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    cfg = gpu_config(data_cache, "syncs", PrecisionConfig(compute_dtype="bf16"), steps=8)
    run_dir = tmp_path / "syncs"
    (run_dir / "logs").mkdir(parents=True)
    world = distributed.init_distributed(cfg.cluster)
    try:
        job = setup(cfg, run_dir, world, StopRequest())
        for step in range(4):  # past the step whose memory is measured
            train_step(job, step)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                train_step(job, 4)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
        assert len(syncs) == 1, [str(w.message)[:200] for w in syncs]
        job.metrics.close()
    finally:
        distributed.close_distributed()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_op_checkpointing_keeps_float8_matmul_outputs():
    """activation_checkpointing=op: backward re-runs no _scaled_mm (the forward's float8 matmul outputs are saved)."""
    float8 = pytest.importorskip("torchao.float8")
    from torch.utils._python_dispatch import TorchDispatchMode

    from trainctl.train.parallel.activations import checkpoint_block

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += func.overloadpacket.__name__ == "_scaled_mm"
            return func(*args, **(kwargs or {}))

    def calls(wrap: bool) -> int:
        torch.manual_seed(0)
        mlp = torch.nn.Sequential(torch.nn.Linear(512, 1024, bias=False), torch.nn.SiLU(),
                                  torch.nn.Linear(1024, 512, bias=False)).cuda().to(torch.bfloat16)
        mlp = float8.convert_to_float8_training(mlp)
        block = checkpoint_block(mlp, "op") if wrap else mlp
        x = torch.randn(4, 128, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        Count.calls = 0
        with Count():
            block(x).float().square().sum().backward()
        return Count.calls

    plain = calls(False)
    assert plain > 0 and calls(True) == plain
