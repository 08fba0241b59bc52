"""Activation bytes that one rank keeps for backward, per token, as the worker's model saves them.

Counted op by op from what autograd saves in the family's module (checked against the saved-tensor hooks
and live storages of trainctl/train/observe/memory_stats.py in tests/dist). What one block keeps per token, per
checkpointing mode, is the family's (models/<family>/spec.py: block_none, block_compiled, block_full,
block_op, block_grad_bytes; models/common/shape.py's docstring has the table); this module adds the layout, the head,
the loss and the stage sums.

Tensor parallelism (sequence parallel) divides it by tp except the two gathered matmul inputs
(2 a d: PrepareModuleInput all-gathers the sequence and the column-parallel matmuls save the
full result). Context parallelism divides the tokens by cp and, because the worker repeats the
kv heads for the ring kernels, counts kv = d. The head keeps the final norm (as a block norm)
and log_softmax's fp32 output (4V per token, full vocabulary on every tp rank: the output
projection gathers the logits); the first stage keeps the int64 token ids.

Checkpointing (trainctl/train/parallel/activations.py):
    full       a block keeps only its input: r d / tp (r: the residual stream's bytes: fp32 under
               autocast and in fp32, the compute dtype under FSDP mixed precision)
    selective  every ac_every-th block of a stage as full, the others as none
    op         the block input, plus the outputs of the matmuls and SDPA the policy saves:
               q, k, v (a(d + 2kv)/tp), wo and w2 outputs (a d each, full size: a row-parallel
               matmul's partial sums before the reduce-scatter), w1, w3 (2 a f / tp), SDPA out
               and log-sum-exp ((a d + 4H) / tp)
"""

from __future__ import annotations

from dataclasses import dataclass

from trainctl.config.schema import ModelConfig
from trainctl.core.loss_head import chunk_temp_bytes, chunk_tokens
from trainctl.models.registry import spec

FP32 = 4
TOKEN_ID_BYTES = 8  # int64 token ids and targets


@dataclass(frozen=True)
class ActLayout:
    """What changes the bytes per token: dtypes and the parallel split of a token's work."""

    compute_bytes: int  # a: matmul outputs and attention tensors
    residual_bytes: int  # r: the residual stream between blocks
    tp: int = 1
    cp: int = 1
    autocast: bool = False  # torch.autocast (none/ddp/zero1 under bf16/fp16): each matmul casts its own input
    chunked_loss: bool = False  # the output projection + cross-entropy run in chunks (core/loss_head.py)
    compiled: bool = False  # train.compile: Inductor decides what a block saves (block_compiled)
    fused_norm: bool = False  # CUDA: rms_norm's fused kernel saves its input and rstd, not x * rstd too


def kv_dim(m: ModelConfig, cp: int) -> int:
    """Width of k and v as SDPA sees them (context parallelism repeats the kv heads up to n_heads)."""
    return spec(m.family).sdpa_kv_dim(m, cp)


def norm_bytes(m: ModelConfig, lay: ActLayout, feeds: int = 1) -> float:
    """One RMSNorm and the saved input of the `feeds` matmuls it feeds (gathered over tp)."""
    return spec(m.family).norm_bytes(m, lay, feeds)


def block_none(m: ModelConfig, lay: ActLayout) -> float:
    """Bytes per token one block keeps without checkpointing."""
    return spec(m.family).block_none(m, lay)


def block_compiled(m: ModelConfig, lay: ActLayout) -> float:
    """Bytes per token a torch.compile'd block keeps without checkpointing."""
    return spec(m.family).block_compiled(m, lay)


def block_full(m: ModelConfig, lay: ActLayout) -> float:
    """A checkpointed block keeps its input only."""
    return spec(m.family).block_full(m, lay)


def block_op(m: ModelConfig, lay: ActLayout) -> float:
    """Per-op checkpointing: the input plus the matmul and attention outputs."""
    return spec(m.family).block_op(m, lay)


def checkpointed_blocks(mode: str, n_blocks: int, every: int) -> int:
    """How many of a stage's blocks a mode wraps (as train/activations.blocks_to_checkpoint)."""
    if mode in ("full", "op"):
        return n_blocks
    if mode == "selective":
        return n_blocks // every
    return 0


def blocks_bytes(m: ModelConfig, lay: ActLayout, mode: str, n_blocks: int, every: int) -> float:
    """Bytes per token the stage's blocks keep under a checkpointing mode."""
    wrapped = checkpointed_blocks(mode, n_blocks, every)
    kept = block_op(m, lay) if mode == "op" else block_full(m, lay)
    plain = block_compiled(m, lay) if lay.compiled else block_none(m, lay)
    return wrapped * kept + (n_blocks - wrapped) * plain


def head_bytes(m: ModelConfig, lay: ActLayout) -> float:
    """Per token, what the last stage's head keeps for backward: the final norm, the targets, and either the
    output matmul's input and log_softmax's output (fp32 over the whole vocabulary: dense) or, chunked, the
    input's gradient computed in forward (the same size as the matmul input norm_bytes counts, which is not saved).
    """
    loss = 0 if lay.chunked_loss else FP32 * m.vocab_size
    return norm_bytes(m, lay) + loss + TOKEN_ID_BYTES


def head_fixed_bytes(m: ModelConfig, lay: ActLayout) -> int:
    """Per micro-batch, whatever its tokens: the chunked loss keeps the output weight's gradient [V, dim], in the
    weight's dtype: fp32 under autocast (the accumulator itself), else the compute dtype."""
    if not lay.chunked_loss:
        return 0
    return (FP32 if lay.autocast else lay.compute_bytes) * m.vocab_size * m.dim


def loss_transient_bytes(m: ModelConfig, lay: ActLayout, tokens: int, head_reduce: int = 0,
                         chunk: int | None = None) -> int:
    """Bytes alive around the loss beyond what the head keeps.

    head_reduce: FSDP2's reduce-scatter input for the head's unit (reduce dtype x its elements), written at the
    head's post-backward while that backward's own gradient is still alive; 0 without FSDP2 or with the head in
    the root unit (tied embeddings: it reduces at the end of backward).
    chunk: tokens per chunk (the plan's choice, memory.estimate); None: core/loss_head.py's floor; 0: no chunk.

    Dense: two fp32 [tokens, V] gradients at the start of backward (nll_loss's backward writes one and
    log_softmax's another before the first is freed; the forward's own peak is lower).
    Chunked (models/loss_head.py), the largest of three moments:
    - a chunk in forward: the one fp32 weight-gradient accumulator [V, dim] (under autocast it is the saved
      gradient head_fixed_bytes counts) and the chunk's temporaries (core/loss_head.chunk_temp_bytes); the weight
      gradient is accumulated in place, no [V, dim] partial;
    - the end of forward for a weight in the compute dtype (FSDP2's or a low-precision weight): the accumulator
      and its cast; under autocast the fp32 weight takes the accumulator as it is;
    - backward scales the saved gradients in place: nothing new but FSDP2's reduce-scatter input.
    """
    if not lay.chunked_loss:
        dense = 2 * FP32 * m.vocab_size * tokens  # the head's unsharded gradient and its reduce-scatter input after
        return max(dense, lay.compute_bytes * m.vocab_size * m.dim // lay.tp + head_reduce) if head_reduce else dense
    c, weight = lay.compute_bytes, m.vocab_size * m.dim
    chunk = min(tokens, chunk_tokens(m.vocab_size, m.dim) if chunk is None else chunk)
    forward = loss_accumulator_bytes(m, lay) + chunk * chunk_temp_bytes(m.vocab_size, c)
    cast = (FP32 + c) * weight if c != FP32 and not lay.autocast else 0
    return max(forward, cast, head_reduce)


def loss_accumulator_bytes(m: ModelConfig, lay: ActLayout) -> int:
    """The chunked head's fp32 weight-gradient accumulator beyond what head_fixed_bytes counts: none under
    autocast, where the accumulator is the saved gradient itself."""
    return 0 if lay.autocast else FP32 * m.vocab_size * m.dim


def block_grad_bytes(m: ModelConfig, lay: ActLayout) -> float:
    """Per token, what one block's backward adds beyond its saved tensors (the family's spec)."""
    return spec(m.family).block_grad_bytes(m, lay)


def recompute_bytes(m: ModelConfig, lay: ActLayout, mode: str) -> float:
    """What one checkpointed block re-creates in backward beyond what it kept (transient, one block at a time)."""
    if mode == "none":
        return 0.0
    kept = block_op(m, lay) if mode == "op" else block_full(m, lay)
    return block_none(m, lay) - kept
