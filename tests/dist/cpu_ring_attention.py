"""Test harness: torch's ring attention on CPU, so the context-parallel worker path runs under gloo.

torch's `context_parallel` routes scaled_dot_product_attention over DTensors to ring
versions of CUDA's flash / memory-efficient / cuDNN kernels only. This registers the same
thing for CPU's flash kernel: each handler unwraps the cp-sharded DTensors and calls torch's
own ring templates (`_templated_ring_attention` and its backward: the kv rotation, the
load-balanced causal skips, the log-sum-exp merge) with `_scaled_dot_product_flash_attention_for_cpu`
in place of the CUDA op. Everything trainctl owns (sequence sharding of tokens, targets and
RoPE rows, the per-rank loss normalisation, gradient averaging over dp x cp) then runs as it
would on GPUs; only the per-chunk kernel differs.

Test-only: it reaches into torch's private CP module; the product keeps refusing cp on CPU.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

try:  # torch >= 2.9 keeps CP under _context_parallel; the old module re-exports part of it
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring
except ImportError:  # pragma: no cover - older layout
    from torch.distributed.tensor.experimental import _attention as ring

aten = torch.ops.aten
SEQ_DIM = 2  # SDPA's [batch, heads, seq, head_dim]


def _bind(op_call: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict:
    """The op's arguments by schema name, defaults filled in."""
    bound = {}
    for index, arg in enumerate(op_call._schema.arguments):
        if index < len(args):
            bound[arg.name] = args[index]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


def _local(value):
    return value.to_local() if isinstance(value, DTensor) else value


def _wrap(tensors, like: DTensor) -> tuple[DTensor, ...]:
    # Every output is sharded on the sequence dim like the query (lse is [batch, heads, seq]).
    return tuple(DTensor.from_local(t, like.device_mesh, like.placements, run_check=False) for t in tensors)


def _ring_forward(op_call, args, kwargs):
    a = _bind(op_call, args, kwargs)
    if a.get("attn_mask") is not None:
        raise NotImplementedError("CPU ring attention: attn_mask is not supported")
    query = a["query"]
    out, lse = ring._templated_ring_attention(
        query.device_mesh.get_group(), SEQ_DIM, aten._scaled_dot_product_flash_attention_for_cpu,
        _local(query), _local(a["key"]), _local(a["value"]),
        is_causal=a["is_causal"], dropout_p=a["dropout_p"], scale=a.get("scale"),
    )
    return _wrap((out, lse), query)


def _ring_backward(op_call, args, kwargs):
    a = _bind(op_call, args, kwargs)
    query = a["query"]
    grads = ring._templated_ring_attention_backward(
        query.device_mesh.get_group(), SEQ_DIM, aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        grad_out=_local(a["grad_out"]), grad_out_name="grad_out",
        query=_local(query), key=_local(a["key"]), value=_local(a["value"]),
        out=_local(a["out"]), logsumexp=_local(a["logsumexp"]),
        is_causal=a["is_causal"], dropout_p=a["dropout_p"], scale=a.get("scale"),
    )
    return _wrap(grads[:3], query)


def install() -> None:
    """Add the CPU flash ops to the handlers `context_parallel` installs on the DTensor dispatcher."""
    ring.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu.default] = _ring_forward
    ring.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = _ring_backward
