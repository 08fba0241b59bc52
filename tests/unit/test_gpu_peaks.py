"""One peak per run for MFU, the plan's and the worker's alike; device names matched to the right kind."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from trainctl.config.schema import ClusterConfig, PrecisionConfig, RunConfig
from trainctl.core.gpus import GPUS, match_gpu
from trainctl.plan.assess import device_peak
from trainctl.train import metrics

pytestmark = pytest.mark.unit


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
    if precision.fp8:
        assert worker == GPUS[gpu].peak_tflops["fp8"] * 1e12
