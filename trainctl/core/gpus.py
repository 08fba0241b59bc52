"""Device kinds: memory, dense peak FLOP/s by compute dtype, and collective bandwidth.

Used by the plan (memory verdict, throughput) and by the worker (MFU). Peaks are the vendors'
dense (no sparsity) tensor-core numbers; fp32 means TF32 tensor cores, which the worker
enables on CUDA. Memory is what the device reports to CUDA (nvidia-smi's total), in GiB.
Bandwidths are per GPU and unidirectional, as collectives use them: `intra_gbs` the NVLink (or
PCIe) bus bandwidth within a node, `inter_gbs` one NIC per GPU across nodes (400 Gb/s
InfiniBand/RoCE for H100/H200/B200, 200 Gb/s for A100/L40S); both are nominal and the plan
says so where it uses them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_gib: float
    peak_tflops: dict  # compute dtype -> dense TFLOP/s
    fp8: bool  # has fp8 tensor cores
    intra_gbs: float = 0.0  # GB/s within a node (0: unknown)
    inter_gbs: float = 0.0  # GB/s across nodes


_HOPPER = {"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "fp32": 494.7}
_AMPERE = {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0}
H100_SXM = GpuSpec("NVIDIA H100 SXM 80GB", 79.6, _HOPPER, True, 450.0, 50.0)
A100_80GB = GpuSpec("NVIDIA A100 SXM 80GB", 80.0, _AMPERE, False, 300.0, 25.0)

GPUS: dict[str, GpuSpec] = {
    "h100_sxm": H100_SXM,
    "h100": H100_SXM,  # the name earlier configs use
    "h100_pcie": GpuSpec(
        "NVIDIA H100 PCIe 80GB", 79.6, {"bf16": 756.0, "fp16": 756.0, "fp8": 1513.0, "fp32": 378.0}, True, 64.0, 50.0
    ),
    # NVIDIA's H100 datasheet, H100 NVL column (figures with sparsity, halved here): BF16 1,671, FP8 3,341,
    # TF32 835 TFLOP/s; 94 GB HBM3 (nvidia-smi: 95830 MiB). PCIe cards: NVLink bridges pair them only, so
    # collectives over more than two go over PCIe Gen5.
    "h100_nvl": GpuSpec(
        "NVIDIA H100 NVL 94GB", 93.6, {"bf16": 835.5, "fp16": 835.5, "fp8": 1670.5, "fp32": 417.5}, True, 64.0, 50.0
    ),
    "h200": GpuSpec("NVIDIA H200 141GB", 140.4, _HOPPER, True, 450.0, 50.0),
    "b200": GpuSpec(
        "NVIDIA B200 180GB", 178.4, {"bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0, "fp32": 1100.0}, True, 900.0, 50.0
    ),
    "a100_80gb": A100_80GB,
    "a100": A100_80GB,  # the name earlier configs use
    "a100_40gb": GpuSpec("NVIDIA A100 40GB", 40.0, _AMPERE, False, 300.0, 25.0),
    "l40s": GpuSpec(
        "NVIDIA L40S 48GB", 44.4, {"bf16": 362.0, "fp16": 362.0, "fp8": 733.0, "fp32": 183.0}, True, 32.0, 25.0
    ),
}

# Substrings of torch.cuda.get_device_name() -> key above; most specific first.
_DEVICE_NAME_PATTERNS = (
    ("H100 PCIe", "h100_pcie"),
    ("H100 NVL", "h100_nvl"),
    ("H100", "h100_sxm"),
    ("H200", "h200"),
    ("B200", "b200"),
    ("A100-SXM4-40GB", "a100_40gb"),
    ("A100-PCIE-40GB", "a100_40gb"),
    ("A100", "a100_80gb"),
    ("L40S", "l40s"),
)


def match_gpu(device_name: str) -> str | None:
    """Map a CUDA device name (e.g. 'NVIDIA H100 80GB HBM3') to a key of GPUS."""
    for pattern, key in _DEVICE_NAME_PATTERNS:
        if pattern.lower() in device_name.lower():
            return key
    return None


# What every MFU figure trainctl prints means (printed beside it): model FLOPs per token over the full,
# not causally halved, sequence, against the compute dtype's dense peak. An fp8 run is measured against the
# bf16 peak too, as torchtitan reports it: an fp8 speed-up then reads as a higher MFU, never as a regression.
MFU_FORMULA = "MFU = tokens/s x (6N + 12*L*d*s, full attention) / (GPUs x bf16 dense peak)"


def peak_flops(gpu: str, compute_dtype: str) -> float | None:
    """Dense peak FLOP/s of one device in the compute dtype (the MFU denominator, fp8 runs included); None if
    unknown."""
    spec = GPUS.get(gpu)
    if spec is None:
        return None
    tflops = spec.peak_tflops.get(compute_dtype)
    return None if tflops is None else tflops * 1e12


def fp8_speedup_bound(gpu: str, compute_dtype: str) -> float | None:
    """The fp8 dense peak over the compute dtype's: what float8 matmuls could gain at most; None if unknown."""
    spec = GPUS.get(gpu)
    if spec is None or "fp8" not in spec.peak_tflops or compute_dtype not in spec.peak_tflops:
        return None
    return spec.peak_tflops["fp8"] / spec.peak_tflops[compute_dtype]
