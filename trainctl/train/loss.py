"""The training loss, one definition for the plain and the pipeline path.

Loss normalization: each rank divides its summed token cross-entropy by the number of
target tokens it sees in the whole optimizer step (all its micro-batches). Every dp rank
sees the same count, so DDP/FSDP's gradient averaging over dp ranks finishes the job:
the gradient equals that of the mean loss over every token of the global batch, whatever
the split into ranks and micro-batches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def summed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy, the softmax in fp32 whatever the compute dtype."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


def logits_of(model: nn.Module, inputs: torch.Tensor, freqs: torch.Tensor | None = None) -> torch.Tensor:
    """The model's logits; freqs: the RoPE rows of a context-parallel slice (see sharded_sequences)."""
    return model(inputs) if freqs is None else model(inputs, freqs)


def token_loss_sum(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                   freqs: torch.Tensor | None = None) -> torch.Tensor:
    """Summed next-token cross-entropy of one micro-batch (evaluation, memory measurements)."""
    return summed_cross_entropy(logits_of(model, inputs, freqs), targets)


class TokenLoss:
    """One micro-batch's training loss: its summed cross-entropy over the tokens of the rank's whole step.

    Both paths call it, the plain loop per micro-batch and the last pipeline stage's loss function.
    """

    def __init__(self, rank_tokens: int):
        self.rank_tokens = rank_tokens

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return summed_cross_entropy(logits, targets) / self.rank_tokens
