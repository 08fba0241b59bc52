"""Where the loss is computed in chunks of tokens, and how large a chunk is: one rule for plan and worker.

The worker (models/loss_head.py) computes the output projection and the cross-entropy chunk by chunk,
so no fp32 [tokens, vocab] tensor is ever whole, except where the output layer is not its own plain
Linear on this rank: tensor parallelism shards it over the vocabulary (its hooks gather whole logits),
a pipeline's schedule calls the loss on the last stage's logits, and float8 swaps a converted output
Linear for torchao's. The plan counts the loss buffers by the same rule, and sizes the chunks
(`planned_chunk_tokens`) from its headroom; the worker asks the plan for that size. `m` and `precision` are
the config's model and precision sections (core imports no config module).
"""

from __future__ import annotations

from trainctl.core.float8 import converts

CHUNK_ALIGN = 128  # tokens per chunk are a multiple of this: matmul tiles stay whole on every device
CHUNK_BYTES = 2**30  # one chunk's fp32 logits at most, whatever the model
DENSE_SHARE = 4  # a chunk's temporaries may take this fraction of the dense loss's fp32 gradients, at least


def chunk_budget(vocab_size: int, dim: int) -> int:
    """Bytes one chunk's fp32 logits [chunk, vocab] may take: a quarter of the fp32 weight-gradient
    accumulator [vocab, dim] the chunked head holds anyway (so the loss's transients stay within 1.25x of
    it), and at most CHUNK_BYTES."""
    return min(CHUNK_BYTES, 4 * vocab_size * dim // 4)


def chunk_tokens(vocab_size: int, dim: int, budget: int | None = None) -> int:
    """The smallest chunk the head uses (tokens): the largest multiple of CHUNK_ALIGN whose fp32 logits fit the
    budget, at least CHUNK_ALIGN (never a handful of tokens: each chunk reads and writes the whole weight-gradient
    accumulator, so small chunks make the head memory-bound)."""
    budget = chunk_budget(vocab_size, dim) if budget is None else budget
    fit = budget // (4 * vocab_size)
    return max(CHUNK_ALIGN, fit // CHUNK_ALIGN * CHUNK_ALIGN)


def chunk_temp_bytes(vocab_size: int, compute_bytes: int) -> int:
    """Bytes one token of a chunk holds while its chunk runs: the fp32 working row of the softmax and, below fp32,
    its logits and gradient rows in the compute dtype (models/loss_head.py's body)."""
    return vocab_size * (4 + (2 * compute_bytes if compute_bytes != 4 else 0))


def planned_chunk_tokens(vocab_size: int, dim: int, tokens: int, room: int, compute_bytes: int) -> int:
    """Tokens per chunk for a micro-batch of `tokens`: as many as the budget affords, whole multiples of
    CHUNK_ALIGN, never fewer than chunk_tokens' floor; all of them (one chunk) where they fit.

    The budget for the chunk's temporaries is the larger of `room` (the plan's headroom under the step's other
    phases: there chunks cost no peak) and a quarter of what the dense loss's two fp32 [tokens, vocab] gradients
    take (DENSE_SHARE): with the [vocab, dim] accumulator that keeps the head at about half the dense head's peak,
    in a few chunks. Fewer chunks read and write the accumulator fewer times: each pass is memory-bound work."""
    if tokens <= 0:
        return chunk_tokens(vocab_size, dim)
    budget = max(room, 2 * 4 * vocab_size * tokens // DENSE_SHARE)
    fit = budget // chunk_temp_bytes(vocab_size, compute_bytes)
    if fit >= tokens:
        return tokens
    return min(tokens, max(chunk_tokens(vocab_size, dim), fit // CHUNK_ALIGN * CHUNK_ALIGN))


def output_in_float8(m, precision) -> bool:
    """Whether float8 converts the output Linear (core/float8.py's rule: name excludes, alignment, fp8_filter)."""
    if not precision.fp8:
        return False
    return converts(precision.fp8_filter, precision.fp8_recipe, "output", m.vocab_size, m.dim, precision.fp8_exclude)


def chunked_loss(m, precision, tp: int, pp: int) -> bool:
    """Whether the worker computes this run's loss in chunks (see the module doc for the exceptions)."""
    return tp == 1 and pp == 1 and not output_in_float8(m, precision)
