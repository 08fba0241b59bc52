"""What a training step holds on a rank besides its model states: saved activations (and their offload),
autocast's weight copies, FSDP2's gathered units and the head's reduce-scatter input.

Separate from plan/memory.py, which sums these and the model states (plan/rank_states.py) into the phases of a
step: each function here sizes one kind of transient buffer, following the worker's libraries (memory.py's doc).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainctl.config.schema import ModelConfig, PrecisionConfig, TrainConfig
from trainctl.core.dims import ParallelDims
from trainctl.core.wrapping import Wrapping, float8_all_gather
from trainctl.plan import activations as act
from trainctl.plan.activations import FP32
from trainctl.plan.experts import ep_local
from trainctl.plan.shapes import (
    Tensor,
    block_tensors,
    embedding_tensor,
    head_tensors,
    tp_local,
)
from trainctl.plan.stages import RankStages

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def fsdp_units(m: ModelConfig, stage: RankStages, tp: int, ep: int = 1) -> dict[str, int]:
    """Elements of each FSDP2 unit (parallelize.apply_fsdp), tp-local: embedding, one block, head, root; a block's
    routed experts counted as its ep rank holds them (E/ep: plan/experts.py)."""
    def numel(ts: list[Tensor]) -> int:
        return sum(ep_local(tp_local(t, tp, m.family), ep).numel for t in ts)

    tied = m.tie_embeddings and stage.first and stage.last
    block = numel(block_tensors(m, stage.layers[0])) if stage.layers else 0
    embedding = numel([embedding_tensor(m)]) if stage.first else 0
    head = numel(head_tensors(m, stage.first)) if stage.last else 0
    if tied:  # one parameter at both ends: it stays in the root unit, with the final norm
        return {"embedding": 0, "block": block, "head": 0, "root": embedding + head}
    return {"embedding": embedding, "block": block, "head": head, "root": 0}


def gathered(units: dict[str, int], n_blocks: int, reshard: bool, c: int, r: int,
             g: int | None = None) -> tuple[int, int, int]:
    """(at the loss, during a block's backward, at the end of backward) bytes of FSDP2's gathered units.

    A unit's backward holds its gathered weights (g bytes per element: the compute dtype's c, or 1 for a
    block's float8 all-gather), its unsharded gradient (compute dtype) and the reduce-scatter input (reduce
    dtype): (g + c + r) per element; a block's backward also has the previous block prefetched (+g). A block's
    norm weights gather in the compute dtype under float8 too (2 dim of about 12 dim^2: left out).
    """
    g = c if g is None else g
    block, root, embedding = units["block"], units["root"], units["embedding"]
    at_end = c * root + max((2 * c + r) * embedding, (g + c + r) * block)
    if reshard:
        return c * (units["head"] + root), c * root + (2 * g + c + r) * block, at_end
    kept = c * (embedding + units["head"] + root) + g * n_blocks * block  # zero2: all kept until their backward
    return kept, kept + (c + r) * block, at_end


def activation_layout(precision: PrecisionConfig, wrap: Wrapping, dims: ParallelDims,
                      chunked_loss: bool = False, compiled: bool = False, device: str = "cpu") -> act.ActLayout:
    c = DTYPE_BYTES[precision.compute_dtype]
    # Under FSDP mixed precision the weights (so the embedding's output) are in the compute dtype;
    # autocast leaves the embedding fp32 and the residual adds promote to fp32.
    residual = c if wrap.fsdp else FP32
    return act.ActLayout(c, residual, dims.tp, dims.cp, wrap.autocast, chunked_loss, compiled,
                         fused_norm=device == "cuda")


@dataclass(frozen=True)
class SavedActivations:
    one: int  # one micro-batch, head included
    everything: int  # every micro-batch in flight
    head: int  # the head's part (all in flight)
    first_block: int  # the first block's (and the token ids') part of everything
    host: int = 0  # moved to host memory by activation offload
    unpacked: int = 0  # offloaded tensors copied back to the device for one block's backward


def activation_bytes(
    m: ModelConfig, train: TrainConfig, lay: act.ActLayout, stage: RankStages, tokens: int
) -> SavedActivations:
    """Activations saved for backward on this rank."""
    mode, n_blocks = train.activation_checkpointing, len(stage.layers)
    blocks = act.blocks_bytes(m, lay, mode, n_blocks, train.ac_every) * tokens
    ids = act.TOKEN_ID_BYTES * tokens if stage.first else 0
    if mode != "selective":
        first = act.blocks_bytes(m, lay, mode, 1, train.ac_every) * tokens
    else:
        first = blocks / max(1, n_blocks)
    head = int(act.head_bytes(m, lay) * tokens) + act.head_fixed_bytes(m, lay) if stage.last else 0
    # A pipeline's last stage also keeps its output logits (the schedule's forward cache) until backward.
    if stage.last and n_blocks < m.n_layers:
        head += lay.compute_bytes * m.vocab_size * tokens
    one = int(blocks + ids)
    everything = int(one * stage.in_flight) + head * stage.last_in_flight
    first_block = everything - head * stage.last_in_flight - one + int(first + ids)
    return SavedActivations(one + head, everything, head * stage.last_in_flight, first_block)


def offloaded(
    saved: SavedActivations, m: ModelConfig, lay: act.ActLayout, train: TrainConfig, stage: RankStages, tokens: int
) -> SavedActivations:
    """train.activation_offload: every saved tensor goes to host memory (torch's save_on_cpu).

    What op-level checkpointing caches (the matmul outputs) is kept by checkpointing itself, not
    saved through autograd's hooks: it stays on the device. In backward each block's tensors come
    back to the device one block at a time.
    """
    wrapped = act.checkpointed_blocks(train.activation_checkpointing, len(stage.layers), train.ac_every)
    cache = (act.block_op(m, lay) - act.block_full(m, lay)) * wrapped if train.activation_checkpointing == "op" else 0
    on_device = int(cache * tokens * stage.in_flight)
    unpacked = int(act.block_none(m, lay) * tokens)
    return SavedActivations(saved.one, on_device, 0, on_device, saved.everything - on_device, unpacked)


def weight_cast_bytes(tensors: list[Tensor], stage: RankStages, c: int, wrapped: int, chunked_loss: bool) -> int:
    """torch.autocast's compute-dtype copies of the matmul weights, kept for backward (not in checkpointed blocks).

    The chunked loss keeps its weight gradient instead of the output weight's copy (activations count it).
    """
    block_matmul = sum(t.numel for t in tensors if t.is_matmul and t.name.startswith("layers."))
    per_block = block_matmul // max(1, len(stage.layers))
    head_matmul = sum(t.numel for t in tensors if t.is_matmul and not t.name.startswith("layers.")
                      and not (chunked_loss and t.name.startswith("output.")))
    return c * (per_block * (len(stage.layers) - wrapped) + head_matmul)


def end_parts(tensors: list[Tensor], stage: RankStages) -> tuple[list[Tensor], list[Tensor]]:
    """(embedding + first block, norm + output): the tensors whose gradients come last and first in backward."""
    first_block = f"layers.{stage.layers[0]}." if stage.layers else None
    first_part = [t for t in tensors
                  if t.name.startswith("tok_embeddings") or (first_block and t.name.startswith(first_block))]
    head_part = [t for t in tensors if t.name.startswith(("norm.", "output."))]
    return first_part, head_part


def head_reduce_bytes(m: ModelConfig, stage: RankStages, dims: ParallelDims, wrap: Wrapping, r: int) -> int:
    """FSDP2's reduce-scatter input for the head's own unit at its post-backward (the loss phase); 0 otherwise."""
    if not (wrap.fully_shard and stage.last):
        return 0
    return (r if wrap.fsdp else FP32) * fsdp_units(m, stage, dims.tp)["head"]


def gathered_bytes(m: ModelConfig, stage: RankStages, dims: ParallelDims, wrap: Wrapping, c: int, r: int,
                   precision: PrecisionConfig | None = None):
    """`gathered` for this wrapping's FSDP2 units; zeros without FSDP2."""
    if not wrap.fully_shard:
        return 0, 0, 0
    units = fsdp_units(m, stage, dims.tp, dims.ep)
    # FSDP2 as DDP (ddp over tp/pp) gathers and reduces fp32: it has no mixed precision.
    unit_c, unit_r = (c, r) if wrap.fsdp else (FP32, FP32)
    g = 1 if float8_all_gather(wrap.fsdp, precision) else unit_c
    return gathered(units, len(stage.layers), wrap.reshard_after_forward, unit_c, unit_r, g)
