"""Temporary shim: the parallel degrees moved to trainctl.core.dims (train/trainer.py still imports them here)."""

from trainctl.core.dims import ParallelDims  # noqa: F401
