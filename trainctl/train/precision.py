"""Mixed precision: which dtype matmuls run in, and how each strategy gets there.

Master weights and optimizer state stay fp32 everywhere. FSDP2 casts its gathered
parameters itself (MixedPrecisionPolicy: bf16 compute, fp32 gradient reduction);
unsharded strategies (none, ddp) use torch.autocast around forward and loss.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from trainctl.config.schema import PrecisionConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FSDP_STRATEGIES = ("zero2", "zero3", "fsdp", "hsdp")


def uses_fsdp(strategy: str) -> bool:
    return strategy in FSDP_STRATEGIES


def fsdp_mp_policy(precision: PrecisionConfig) -> MixedPrecisionPolicy:
    """bf16 parameters in compute with fp32 (or the configured) gradient reduction; plain fp32 otherwise."""
    if precision.compute_dtype == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=DTYPES[precision.compute_dtype], reduce_dtype=DTYPES[precision.reduce_dtype])


def autocast_context(precision: PrecisionConfig, strategy: str, device: torch.device) -> contextlib.AbstractContextManager:
    """A fresh context for one forward + loss: autocast for unsharded bf16, nothing otherwise."""
    if precision.compute_dtype == "fp32" or uses_fsdp(strategy):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision.compute_dtype])
