"""Accelerator specs: dense peak FLOP/s by compute dtype, and memory.

Used by the plan (throughput and memory estimates) and by the worker (MFU).
Peaks are the vendors' dense (no sparsity) tensor-core numbers; fp32 means
TF32 tensor cores, which the worker enables on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_gib: float
    peak_tflops: dict  # compute dtype -> dense TFLOP/s
    fp8: bool  # has fp8 tensor cores


GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec("NVIDIA H100 SXM 80GB", 80, {"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "fp32": 494.7}, True),
    "h100_pcie": GpuSpec("NVIDIA H100 PCIe 80GB", 80, {"bf16": 756.0, "fp16": 756.0, "fp8": 1513.0, "fp32": 378.0}, True),
    "h200": GpuSpec("NVIDIA H200 141GB", 141, {"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "fp32": 494.7}, True),
    "b200": GpuSpec("NVIDIA B200 180GB", 180, {"bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0, "fp32": 1100.0}, True),
    "a100": GpuSpec("NVIDIA A100 SXM 80GB", 80, {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0}, False),
    "a100_40gb": GpuSpec("NVIDIA A100 40GB", 40, {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0}, False),
    "l40s": GpuSpec("NVIDIA L40S 48GB", 48, {"bf16": 362.0, "fp16": 362.0, "fp8": 733.0, "fp32": 183.0}, True),
}

# Substrings of torch.cuda.get_device_name() -> key above; most specific first.
_DEVICE_NAME_PATTERNS = (
    ("H100 PCIe", "h100_pcie"),
    ("H100", "h100"),
    ("H200", "h200"),
    ("B200", "b200"),
    ("A100-SXM4-40GB", "a100_40gb"),
    ("A100-PCIE-40GB", "a100_40gb"),
    ("A100", "a100"),
    ("L40S", "l40s"),
)


def match_gpu(device_name: str) -> str | None:
    """Map a CUDA device name (e.g. 'NVIDIA H100 80GB HBM3') to a key of GPUS."""
    for pattern, key in _DEVICE_NAME_PATTERNS:
        if pattern.lower() in device_name.lower():
            return key
    return None


def peak_flops(gpu: str, compute_dtype: str, fp8: bool = False) -> float | None:
    """Dense peak FLOP/s of one device for the dtype its matmuls run in; None if unknown."""
    spec = GPUS.get(gpu)
    if spec is None:
        return None
    key = "fp8" if fp8 else compute_dtype
    tflops = spec.peak_tflops.get(key)
    return None if tflops is None else tflops * 1e12
