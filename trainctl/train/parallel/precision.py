"""Mixed precision: which dtype matmuls run in, and how each wrapping gets there.

Master weights and optimizer state stay fp32 everywhere. Which of the two paths a run takes is
core.wrapping's decision: FSDP2 casts its gathered parameters itself (MixedPrecisionPolicy: compute
dtype parameters, reduce-dtype gradient reduction); every other wrapping uses torch.autocast around
forward and loss.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from trainctl.config.schema import PrecisionConfig
from trainctl.core.wrapping import Wrapping

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def fsdp_mp_policy(wrap: Wrapping) -> MixedPrecisionPolicy:
    """The decision's parameter and reduce dtypes; plain fp32 (no policy) when it has none.

    cast_forward_inputs=False: the blocks take the RoPE table as an argument, and FSDP2 would cast it
    to the compute dtype (bf16 cos/sin) where the autocast path keeps fp32. Nothing else needs the cast:
    the embedding's compute-dtype weight makes the hidden states compute-dtype from the start.
    """
    if not wrap.mixed_precision:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=DTYPES[wrap.param_dtype], reduce_dtype=DTYPES[wrap.reduce_dtype],
                                cast_forward_inputs=False)


def autocast_for(wrap: Wrapping, precision: PrecisionConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """A fresh context for one forward + loss: autocast when the decision says so, nothing otherwise."""
    if not wrap.autocast:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision.compute_dtype])

