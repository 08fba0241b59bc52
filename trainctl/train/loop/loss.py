"""The training loss, one definition for the plain and the pipeline path.

Loss normalization: each rank divides its summed token cross-entropy by the number of
target tokens it sees in the whole optimizer step (all its micro-batches). Every dp rank
sees the same count, so DDP/FSDP's gradient averaging over dp ranks finishes the job:
the gradient equals that of the mean loss over every token of the global batch, whatever
the split into ranks and micro-batches.

The sum itself is the model's (`model(inputs, targets=...)`): chunked over tokens by its output head,
so no fp32 [tokens, vocab] tensor is ever whole (models/loss_head.py). A pipeline's last stage gets
logits from its schedule and sums them densely.

Masked data (chat / instruction datasets): targets outside the answers are IGNORE_INDEX and add nothing to
the sums; the normalizer is then the count of the targets that do count, which differs between ranks, so
it is summed over the world once per step (`step_divisor`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from trainctl.core import rundir
from trainctl.models.loss_head import IGNORE_INDEX, OutputHead, dense_loss_sum


def use_planned_chunks(model: nn.Module, run_dir: Path) -> int:
    """Gives the chunked output head the plan's tokens per chunk, read from the run directory's plan record (the
    launcher computed it for this config; the plan counts the memory of exactly these chunks). The worker does not
    import the planner: it trusts the record. Without a readable one the head keeps its own default chunk.
    Returns the chunk (0: no chunked head on this rank, or no planned chunk)."""
    heads = [m for m in model.modules() if isinstance(m, OutputHead) and m.chunked]
    if not heads:
        return 0
    chunk = rundir.planned_loss_chunk(run_dir) or 0
    for head in heads:
        head.chunk = chunk or None
    return chunk


def token_loss_sum(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                   freqs: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Summed next-token cross-entropy of one micro-batch, fp32; freqs: a context-parallel slice's RoPE rows;
    positions: the tokens' positions in their packed documents (data.document_mask)."""
    extra = {} if positions is None else {"positions": positions}  # without: the very call of before
    if freqs is None:
        return model(inputs, targets=targets, **extra)
    return model(inputs, freqs, targets=targets, **extra)


def counted_targets(micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Targets that count in the loss (not IGNORE_INDEX) over a rank's micro-batches (host tensors: no sync)."""
    return sum(int((targets != IGNORE_INDEX).sum()) for _, targets in micro_batches)


def step_divisor(micro_batches: list[tuple[torch.Tensor, torch.Tensor]], cp: int, device: torch.device) -> float:
    """A rank's loss divisor for one step of masked data, from the counted targets of the whole global batch.

    DDP / FSDP average gradients over the dp x cp ranks, so each rank divides its summed loss by
    global_count / (dp x cp): the average is then the gradient of the mean over every counted target of the
    global batch, however unevenly the masks spread them over ranks and micro-batches. Every rank of a dp
    replica (its cp, tp and pp ranks) reads the same batch, so the world's sum of the ranks' counts is
    global_count x world / dp, and the divisor is that sum / (world x cp). One all-reduce and one host sync
    per step; 0 when no target of the global batch counts (the step is skipped).
    """
    count = torch.tensor(float(counted_targets(micro_batches)), dtype=torch.float64, device=device)
    world = 1
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        world = dist.get_world_size()
        dist.all_reduce(count)
    return count.item() / (world * cp)


class TokenLoss:
    """One micro-batch's training loss: its summed cross-entropy over the tokens of the rank's whole step.

    The plain loop calls `of_model` per micro-batch, the last pipeline stage calls it on logits;
    both go through `normalize`.
    """

    def __init__(self, rank_tokens: float, adjust: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.adjust = adjust  # hooks.on_loss of this step (None: nothing to call)
        self.rank_tokens = rank_tokens

    def normalize(self, summed: torch.Tensor) -> torch.Tensor:
        loss = summed / self.rank_tokens
        return loss if self.adjust is None else self.adjust(loss)

    def of_model(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                 freqs: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.normalize(token_loss_sum(model, inputs, targets, freqs, positions))

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.normalize(dense_loss_sum(logits, targets))
