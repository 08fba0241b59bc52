"""One peak per run for MFU, the plan's and the worker's alike; device names matched to the right kind."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from trainctl.config.schema import ClusterConfig, PrecisionConfig, RunConfig
from trainctl.core.gpus import GPUS, match_gpu
from trainctl.plan.assess import device_peak
from trainctl.train.observe import metrics


@pytest.mark.parametrize("name, kind", [
    ("NVIDIA H100 80GB HBM3", "h100_sxm"),
    ("NVIDIA H100 PCIe", "h100_pcie"),
    ("NVIDIA H100 NVL", "h100_nvl"),
    ("NVIDIA H200", "h200"),
])
def test_device_names_match_their_kind(name, kind):
    assert match_gpu(name) == kind


def test_h100_nvl_is_not_an_sxm():
    nvl, sxm = GPUS["h100_nvl"], GPUS["h100_sxm"]
    assert nvl.peak_tflops["bf16"] < sxm.peak_tflops["bf16"] and nvl.memory_gib > sxm.memory_gib


@pytest.mark.parametrize("gpu, device_name", [("h100_sxm", "NVIDIA H100 80GB HBM3"), ("h100_nvl", "NVIDIA H100 NVL")])
@pytest.mark.parametrize("precision", [
    PrecisionConfig(compute_dtype="bf16"),
    PrecisionConfig(compute_dtype="bf16", fp8=True),
    PrecisionConfig(compute_dtype="fp32"),
], ids=["bf16", "fp8", "fp32"])
def test_the_worker_divides_by_the_plans_peak(monkeypatch, gpu, device_name, precision):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: device_name)
    cfg = replace(RunConfig(), precision=precision, cluster=replace(ClusterConfig(), device="cuda", gpu=gpu))
    worker = metrics.device_peak_flops(torch.device("cuda", 0), precision)
    assert worker == device_peak(cfg) is not None
    if precision.fp8:  # against the bf16 peak, as torchtitan reports it: an fp8 speed-up reads as a higher MFU
        assert worker == GPUS[gpu].peak_tflops["bf16"] * 1e12



def _resolved(precision: str, *more: str):
    from trainctl.config import compose
    from trainctl.config.validate import resolve

    return resolve(compose.compose(["recipe=llama1b_bench", f"precision={precision}", *more]))


def test_fp8_compute_follows_the_share_of_flops_that_runs_in_fp8():
    """Amdahl over the converted Linears: 6 x their weights per token run fp8, attention and the head stay bf16."""
    from trainctl.plan.flops import flops_per_token
    from trainctl.plan.runplan import build
    from trainctl.plan.throughput import FP8_GEMM_EFFICIENCY

    bf16_cfg, fp8_cfg = _resolved("bf16"), _resolved("fp8", "precision.fp8_filter=all")
    bf16, fp8 = build(bf16_cfg), build(fp8_cfg)
    m, seq = fp8_cfg.model, fp8_cfg.train.seq_len
    q, kv = m.n_heads * (m.dim // m.n_heads), m.n_kv_heads * (m.dim // m.n_heads)
    block = m.dim * (2 * q + 2 * kv) + 3 * m.dim * m.ffn_dim  # wq wo wk wv w1 w2 w3 (the head is excluded)
    share = 6.0 * m.n_layers * block / flops_per_token(m, seq)
    ratio = GPUS[fp8_cfg.cluster.gpu].peak_tflops["fp8"] / GPUS[fp8_cfg.cluster.gpu].peak_tflops["bf16"]
    expected = (1 - share) + share / (FP8_GEMM_EFFICIENCY[fp8_cfg.precision.fp8_recipe] * ratio)
    assert fp8.step_time.compute_s / bf16.step_time.compute_s == pytest.approx(expected)
    assert 1.0 < 1 / expected < ratio  # a speed-up, never the whole peak ratio
    assert fp8.peak_flops_per_device == bf16.peak_flops_per_device  # MFU against the bf16 peak


def test_excluding_every_block_linear_leaves_fp8_at_the_bf16_time():
    from trainctl.plan.runplan import build

    bf16 = build(_resolved("bf16"))
    fp8 = build(_resolved("fp8", "precision.fp8_exclude=[output,attention,feed_forward]"))
    assert fp8.step_time.compute_s == pytest.approx(bf16.step_time.compute_s)
