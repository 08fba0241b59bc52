"""What only a CUDA device can show: `pytest -m gpu` on a lent GPU (scripts/gpu_proof.sh tests). Skipped elsewhere.

- bf16, fp16 and compiled bf16 loss curves against an fp32 run of the same model, data and init over 30 steps;
  fp8 (tensorwise, rowwise, compiled tensorwise) against bf16 on the mean loss of the last 10 steps; the
  tolerances and their reasons are in tests/gpu/configs.py.
- resume on CUDA gives the uninterrupted run's losses bitwise (when the uninterrupted run itself is
  reproducible on this device: run twice first).
- the plan's per-rank peak against torch.cuda.max_memory_allocated within 10%, across checkpointing modes and
  micro-batch sizes; a miss prints planned (and its phase) and measured.
- SDPA runs cuDNN or flash attention kernels (profiler kernel names), not the math fallback.
- one host sync per training step (the guard's agreed all-reduce), counted by CUDA's sync debug mode.
- op-level checkpointing re-runs no float8 matmul (torch._scaled_mm counted where torchao calls it).
Every config here comes from tests/gpu/configs.py, whose builders tests/unit/test_gpu_configs.py runs on CPU.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch

from tests.dist.worker_runs import (
    WORKER_TIMEOUT_S,
    check_worker,
    records,
    run_worker,
    series,
    to_yaml,
    train_and_check,
    write_run_dir,
)
from tests.gpu import configs
from tests.gpu.configs import gpu_config
from tests.helpers import run_group, torchrun_cmd, worker_env

CUDA = torch.cuda.is_available()
GiB = 2**30


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory, data_cache):
    return train_and_check(tmp_path_factory.mktemp("fp32"), gpu_config(data_cache, "fp32"), None)


@pytest.fixture(scope="module")
def bf16_runs(tmp_path_factory, data_cache):
    """The bf16 run fp8 replaces, eager and compiled, trained once each when first asked for."""
    runs = {}

    def run(compile_: bool):
        if compile_ not in runs:
            cfg = gpu_config(data_cache, f"bf16-{compile_}", configs.BF16, compile_)
            runs[compile_] = train_and_check(tmp_path_factory.mktemp("bf16"), cfg, None)
        return runs[compile_]

    return run


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(configs.CLOSE_TO_FP32))
def test_lower_precision_follows_the_fp32_loss_curve(tmp_path, data_cache, fp32_run, name):
    precision, compile_, tolerance = configs.CLOSE_TO_FP32[name]
    run = train_and_check(tmp_path, gpu_config(data_cache, name, precision, compile_), None)
    got, want = series(run, "loss"), series(fp32_run, "loss")
    assert len(got) == len(want) == configs.STEPS
    worst = max(abs(g - w) / w for g, w in zip(got, want, strict=True))
    assert worst <= tolerance, f"{name}: worst relative loss difference {worst:.4f} > {tolerance}"
    assert got[-1] < got[0] * 0.9  # and it trains


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(configs.CLOSE_TO_BF16))
def test_fp8_follows_the_bf16_loss_curve(tmp_path, data_cache, bf16_runs, name):
    precision, compile_ = configs.CLOSE_TO_BF16[name]
    got = series(train_and_check(tmp_path, gpu_config(data_cache, name, precision, compile_), None), "loss")
    want = series(bf16_runs(compile_), "loss")
    assert len(got) == len(want) == configs.STEPS
    n = configs.LAST_STEPS
    mine, theirs = sum(got[-n:]) / n, sum(want[-n:]) / n
    difference = abs(mine - theirs) / theirs
    print(f"{name}: mean loss of the last {n} steps {mine:.4f} vs bf16 {theirs:.4f} ({difference:+.4f})")
    assert difference <= configs.FP8_TOLERANCE, (
        f"{name}: mean loss of the last {n} steps {mine:.4f} vs bf16 {theirs:.4f}: relative difference "
        f"{difference:.4f} > {configs.FP8_TOLERANCE}")
    assert got[-1] < got[0] * 0.9  # and it trains


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_resume_on_cuda_is_bitwise(tmp_path, data_cache):
    cfg = configs.resume_config(data_cache)
    whole = series(train_and_check(tmp_path / "a", cfg, None), "loss")
    again = series(train_and_check(tmp_path / "b", cfg, None), "loss")
    if whole != again:
        pytest.skip(f"this device is not run-to-run reproducible (max diff "
                    f"{max(abs(x - y) for x, y in zip(whole, again, strict=True)):.2e}): bitwise resume is moot")
    first = configs.resume_split_config(cfg)
    run_dir = train_and_check(tmp_path / "c", first, None)
    # The same run directory asked for 20 steps: it resumes from its step-10 checkpoint.
    (run_dir / "config.yaml").write_text(to_yaml(replace(first, train=replace(first.train, steps=20))))
    proc = run_worker(run_dir, None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = [r["loss"] for r in records(run_dir, "train")]
    assert resumed[-10:] == whole[-10:]


def memory_message(case: str, planned, record: dict) -> str:
    """Planned (with its peak phase and every phase), measured (with its step and source): what a miss needs."""
    phases = ", ".join(f"{k} {v / GiB:.3f}" for k, v in planned.phases().items())
    return (f"{case}: planned {planned.peak / GiB:.3f} GiB at phase {planned.peak_phase} ({phases}); measured "
            f"{record['peak_bytes'] / GiB:.3f} GiB at step {record.get('step')} ({record.get('peak_source')}); "
            f"error {planned.peak / record['peak_bytes'] - 1:+.2%}")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("mode, micro_batch", configs.MEMORY_CASES)
def test_the_plans_peak_matches_max_memory_allocated(tmp_path, data_cache, mode, micro_batch):
    cfg = configs.memory_config(data_cache, mode, micro_batch)
    run = train_and_check(tmp_path, cfg, None)
    (record,) = records(run, "memory")
    planned = configs.planned_memory(cfg)
    message = memory_message(f"{mode} x {micro_batch}", planned, record)
    print(message)
    assert record["peak_source"] == "cuda_max_memory_allocated", message
    assert record["peak_bytes"] == pytest.approx(planned.peak, rel=0.10), message


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("first", ["cudnn", "flash"])
@pytest.mark.parametrize("n_kv_heads", [4, 8])
def test_attention_runs_the_kernel_the_plan_predicts(first, n_kv_heads):
    from torch.profiler import ProfilerActivity, profile

    from trainctl.config.schema import ClusterConfig, PrecisionConfig, RunConfig, TrainConfig
    from trainctl.models.build import build_model
    from trainctl.models.common.attention import attention_backends
    from trainctl.plan.attention_kernel import predicted_kernel

    model_cfg = replace(configs.MODEL, n_kv_heads=n_kv_heads)
    torch.manual_seed(0)
    model = build_model(model_cfg, "cuda").to(torch.bfloat16)
    model.init_weights()
    attention = model.layers["0"].attention
    x = torch.randn(4, 512, configs.MODEL.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
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
    from trainctl.train.loop.job_setup import setup
    from trainctl.train.loop.step import train_step
    from trainctl.train.loop.stop import StopRequest
    from trainctl.train.parallel import distributed

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    cfg = configs.syncs_config(data_cache)
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
def test_op_checkpointing_keeps_float8_matmul_outputs(monkeypatch):
    """activation_checkpointing=op: backward re-runs no float8 matmul (counted where torchao calls torch._scaled_mm)."""
    pytest.importorskip("torchao.float8")
    from tests.unit.test_op_checkpointing import float8_matmul_calls

    plain, op, full = (float8_matmul_calls(monkeypatch, mode, "cuda") for mode in ("", "op", "full"))
    print(f"torch._scaled_mm calls, forward + backward: plain {plain}, op {op}, full {full}")
    assert plain > 0 and op == plain and full > plain


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_a_rank_forked_by_the_agent_trains_on_cuda(tmp_path, data_cache, fp32_run):
    """cluster.rank_start=fork on CUDA (train/agent.py): importing torch and the worker in the agent initialises no
    CUDA, and the forked rank trains the fp32 run on the device. `auto` keeps exec on cuda until this holds."""
    cfg = gpu_config(data_cache, "fp32-forked")
    run_dir = write_run_dir(tmp_path, replace(cfg, cluster=replace(cfg.cluster, rank_start="fork")))
    proc = run_group(torchrun_cmd(1, "-m", "trainctl.train", str(run_dir), fork=True), WORKER_TIMEOUT_S,
                     worker_env())
    check_worker(run_dir, proc)
    got, want = series(run_dir, "loss"), series(fp32_run, "loss")
    assert len(got) == len(want) == configs.STEPS and got[-1] < got[0] * 0.9
    print(f"forked rank on cuda: loss {got[0]:.4f} -> {got[-1]:.4f}; plain process {want[0]:.4f} -> {want[-1]:.4f}")
