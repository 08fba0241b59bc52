"""Tensor parallelism with sequence parallelism (Megatron-style), on DTensor's `parallelize_module`.

The styles per module are the family's (trainctl/models/<family>/parallel.py: root_plan, block_plan).

Inside a block the matmuls are split over the tp ranks: wq/wk/wv and w1/w3 by output
columns (each rank owns n_heads/tp query heads, n_kv_heads/tp kv heads and ffn_dim/tp
hidden units), wo and w2 by input rows (their partial sums are reduce-scattered).
Between the matmuls the residual stream is sharded on the sequence dim (Shard(1)):
RMSNorm and the residual adds work per token, so each rank does them on seq/tp tokens,
and activations between blocks cost 1/tp of the memory. The attention and MLP inputs
are all-gathered back to the full sequence (PrepareModuleInput), so RoPE sees every
position in order and the attention code only has to infer its local head count from
the projected tensor's shape. The output projection is column-parallel over the vocab
and gathers full logits (Replicate, as a plain tensor): the loss code is unchanged.

TP changes only the summation order of the split matmuls (row-parallel partial sums
are added by a collective), so fp32 results match one process to rounding.
"""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from trainctl.models.build import family_parallel

log = logging.getLogger("trainctl.train")


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, float8_tensorwise: bool = False) -> None:
    """Shard the meta-device model's weights over `tp_mesh` in place (after float8, before AC and FSDP)."""
    ends = model.output is not None and model.tok_embeddings is not None
    tied = ends and model.output.weight is model.tok_embeddings.weight
    plans = family_parallel(model.cfg)
    parallelize_module(model, tp_mesh, plans.root_plan(model))
    if model.output is not None:
        # Its weight is vocab-sharded and its hooks gather the logits: the model computes the dense loss.
        model.output.chunked = False
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, plans.block_plan(block, float8_tensorwise))
    if tied:
        # Both plans shard the [vocab, dim] weight on dim 0, but each made its own DTensor: tie them again.
        model.output.weight = model.tok_embeddings.weight
    local = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    log.info("tensor parallel x%d: this rank holds %d of %d parameter elements (before expert parallelism and "
             "FSDP2 split them further)", tp_mesh.size(), local, total)


def apply_replicate_over_tp(model: nn.Module, dp_mesh: DeviceMesh) -> None:
    """Data-parallel replication (strategy ddp) of a TP model: FSDP2 over a (dp_replicate x dp_shard=1) mesh.

    DDP cannot bucket DTensor parameters; FSDP2 with a shard group of one holds whole (TP-local)
    weights and all-reduces gradients over dp_replicate, which is what DDP does. Parameters stay
    fp32 (DDP's precision is autocast's), and nothing is resharded since nothing is sharded.
    """
    assert dp_mesh.ndim == 2 and dp_mesh.size(1) == 1, dp_mesh
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=False)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False)


def settle_partial_gradients(model: nn.Module) -> None:
    """Reduce every gradient TP left as a partial sum (Replicate weights fed Shard(1) tokens: the norms, and a
    mixture of experts' router and experts, models/common/parallel.LocalTokensMoE) to the layout of its weight,
    once per step, before clipping and the optimizer see it.

    Optimizers take a momentum buffer as a copy of the first gradient: a Partial one stays Partial, and DCP
    refuses to save it. Under torch 2.11 the multi-tensor SGD step also mixes the partial sums with the
    replicated weights wrongly (the weights drift from one process's); one explicit reduction here is also
    cheaper than the implicit ones each optimizer op would do. A no-op where no gradient is Partial (FSDP2
    reduces its own; DDP's are plain tensors).
    """
    for p in model.parameters():
        grad = p.grad
        if isinstance(grad, DTensor) and any(placement.is_partial() for placement in grad.placements):
            p.grad = grad.redistribute(grad.device_mesh, p.placements)
