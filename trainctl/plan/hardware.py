"""Temporary shim: the GPU table moved to trainctl.core.gpus (train/metrics.py still imports it here)."""

from trainctl.core.gpus import GPUS, GpuSpec, device_kinds, match_gpu, peak_flops  # noqa: F401
