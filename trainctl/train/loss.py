"""The training loss, one definition for the plain and the pipeline path.

Loss normalization: each rank divides its summed token cross-entropy by the number of
target tokens it sees in the whole optimizer step (all its micro-batches). Every dp rank
sees the same count, so DDP/FSDP's gradient averaging over dp ranks finishes the job:
the gradient equals that of the mean loss over every token of the global batch, whatever
the split into ranks and micro-batches.

The sum itself is the model's (`model(inputs, targets=...)`): chunked over tokens by its output head,
so no fp32 [tokens, vocab] tensor is ever whole (models/loss_head.py). A pipeline's last stage gets
logits from its schedule and sums them densely.
"""

from __future__ import annotations

import torch
from torch import nn

from trainctl.models.loss_head import dense_loss_sum


def token_loss_sum(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                   freqs: torch.Tensor | None = None) -> torch.Tensor:
    """Summed next-token cross-entropy of one micro-batch, fp32; freqs: a context-parallel slice's RoPE rows."""
    if freqs is None:
        return model(inputs, targets=targets)
    return model(inputs, freqs, targets=targets)


class TokenLoss:
    """One micro-batch's training loss: its summed cross-entropy over the tokens of the rank's whole step.

    The plain loop calls `of_model` per micro-batch, the last pipeline stage calls it on logits;
    both go through `normalize`.
    """

    def __init__(self, rank_tokens: int):
        self.rank_tokens = rank_tokens

    def normalize(self, summed: torch.Tensor) -> torch.Tensor:
        return summed / self.rank_tokens

    def of_model(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                 freqs: torch.Tensor | None = None) -> torch.Tensor:
        return self.normalize(token_loss_sum(model, inputs, targets, freqs))

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.normalize(dense_loss_sum(logits, targets))
