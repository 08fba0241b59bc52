"""Tensor parallelism with sequence parallelism (Megatron-style), on DTensor's `parallelize_module`.

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
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

log = logging.getLogger("trainctl.train")


def root_plan(model: nn.Module) -> dict:
    """Embedding, final norm and output projection (the parts outside the blocks) that `model` holds.

    A pipeline stage may lack some of them; between stages the hidden states stay sequence-sharded,
    so each tp rank sends and receives its own [batch, seq/tp, dim] slice.
    """
    plan = {
        # Rowwise over the vocab: each rank embeds the ids it owns; the sum is reduce-scattered on seq.
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=True),
    }
    return {name: style for name, style in plan.items() if getattr(model, name, None) is not None}


def _is_float8(module: nn.Module | None) -> bool:
    return type(module).__name__ == "Float8Linear"


def linear_styles(float8_tensorwise: bool):
    """(Colwise, Rowwise, PrepareInput) classes: torchao's float8 ones move activations in float8."""
    if float8_tensorwise:
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
    return ColwiseParallel, RowwiseParallel, PrepareModuleInput


def block_plan(block: nn.Module | None = None, float8_tensorwise: bool = False) -> dict:
    """One transformer block: sequence-parallel norms, column- then row-parallel matmuls.

    With float8 (tensorwise) a sub-layer whose Linears are all Float8Linear uses torchao's float8
    styles: its input is cast to float8 before the sequence all-gather (half the bytes). Layers
    left in bf16 (excluded, unaligned) and the rowwise recipe use the plain styles.
    """

    def styles(*names: str):
        layers = [block.get_submodule(n) for n in names] if block is not None else []
        return linear_styles(float8_tensorwise and bool(layers) and all(_is_float8(m) for m in layers))

    attn_col, attn_row, attn_in = styles("attention.wq", "attention.wk", "attention.wv", "attention.wo")
    mlp_col, mlp_row, mlp_in = styles("feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
    # Qwen3's per-head q/k norms see this rank's heads ([batch, seq, heads/tp, head_dim]): their input is a shard
    # on the heads dim and their weight a replicated DTensor, whose gradient DTensor sums over the tp ranks
    # (each saw only its heads); a plain weight would take a different gradient on every rank and drift apart.
    qk_norms = {} if block is None or getattr(block.attention, "q_norm", None) is None else {
        "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True)}
    return {
        **qk_norms,
        "attention_norm": SequenceParallel(),
        # (x, freqs): gather x to the full sequence; the RoPE table is a plain, replicated buffer.
        "attention": attn_in(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": attn_col(),
        "attention.wk": attn_col(),
        "attention.wv": attn_col(),
        "attention.wo": attn_row(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": mlp_in(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": mlp_col(),
        "feed_forward.w2": mlp_row(output_layouts=Shard(1)),
        "feed_forward.w3": mlp_col(),
    }


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, float8_tensorwise: bool = False) -> None:
    """Shard the meta-device Llama's weights over `tp_mesh` in place (after float8, before AC and FSDP)."""
    ends = model.output is not None and model.tok_embeddings is not None
    tied = ends and model.output.weight is model.tok_embeddings.weight
    parallelize_module(model, tp_mesh, root_plan(model))
    if model.output is not None:
        # Its weight is vocab-sharded and its hooks gather the logits: the model computes the dense loss.
        model.output.chunked = False
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan(block, float8_tensorwise))
    if tied:
        # Both plans shard the [vocab, dim] weight on dim 0, but each made its own DTensor: tie them again.
        model.output.weight = model.tok_embeddings.weight
    local = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    log.info("tensor parallel x%d: this rank holds %d of %d parameter elements", tp_mesh.size(), local, total)


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
