"""A preference objective's part of the step: per-micro-batch forward and backward, the pair metrics, evaluation.

The loss of a step is the mean over the rank's pairs of losses.dpo (or losses.simpo); DDP / FSDP average the
gradients over the dp ranks, so the update is that of the mean over the global batch's pairs whatever the split
into ranks and micro-batches (each rank holds the same number of pairs). Tensor-parallel ranks compute the same
loss on the same pairs, as they do for SFT.

DPO's reference runs first, under no_grad (reference.py: the adapters switched off, or the frozen copy); its
logits live only until their log-probabilities are summed. Then the policy's forward and backward.

Metrics (metrics.jsonl, `trainctl status`), agreed over every rank with one all-reduce per step: the reward
margin (chosen minus rejected implicit reward), the accuracy (share of pairs whose chosen reward is higher),
the rewards and the policy's summed log-probabilities of the chosen and the rejected answers.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from trainctl.config.schema import TrainConfig
from trainctl.core import objectives
from trainctl.train.loop.micro_batch import MicroBatchContext
from trainctl.train.preference import losses
from trainctl.train.preference.reference import adapters_off

# The agreed sums, in this order; each metric is its sum over the pairs (STATS[0]).
STATS = ("pairs", "loss", *objectives.PAIR_METRICS)


class PreferenceObjective:
    """train.objective=dpo|simpo (core/objectives.py) on batches of pairs (pairs.py)."""

    def __init__(self, train: TrainConfig, reference: nn.Module | None = None):
        self.train, self.reference = train, reference  # reference None: dpo with LoRA uses adapters_off
        self.last: dict[str, float] = {}  # the last step's agreed metrics
        self.last_eval: dict[str, float] = {}  # the last evaluation's, with its pair count and mean loss

    def _reference_logps(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        context = contextlib.nullcontext() if self.reference is not None else adapters_off(model)
        with torch.no_grad(), context:
            logits = (self.reference or model)(inputs)
            return losses.sequence_logps(logits, targets)[0]

    def pair_losses(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor
                    ) -> tuple[losses.PairLosses, torch.Tensor, torch.Tensor]:
        """(the pairs' losses, the policy's log-probabilities of the chosen and the rejected answers) of one
        micro-batch whose first half of rows are the chosen answers and second half the rejected ones."""
        half = targets.shape[0] // 2
        train = self.train
        reference = self._reference_logps(model, inputs, targets) if train.objective == "dpo" else None
        logps, counts = losses.sequence_logps(model(inputs), targets)
        chosen, rejected = logps[:half], logps[half:]
        if reference is not None:
            out = losses.dpo(chosen, rejected, reference[:half], reference[half:], train.dpo_beta,
                             train.dpo_label_smoothing)
        else:
            out = losses.simpo(chosen, rejected, counts[:half], counts[half:], train.simpo_beta, train.simpo_gamma)
        return out, chosen.detach(), rejected.detach()

    def forward_backward(self, model: nn.Module, micro_batches: list, contexts: MicroBatchContext,
                         scale_loss=lambda loss: loss, adjust=None) -> torch.Tensor:
        """Accumulate the gradients of this rank's mean pair loss; returns it (no sync); sets `last`."""
        pairs = sum(targets.shape[0] // 2 for _, targets in micro_batches)
        total = torch.zeros((), device=contexts.device)
        sums = torch.zeros(len(STATS), dtype=torch.float64, device=contexts.device)
        for index, batch in enumerate(micro_batches):
            inputs, targets = (t.to(contexts.device, non_blocking=True) for t in batch)
            with contexts.around_backward(inputs, targets, last=index == len(micro_batches) - 1):
                with contexts.forward():
                    out, chosen, rejected = self.pair_losses(model, inputs, targets)
                    loss = out.losses.sum() / pairs
                    loss = loss if adjust is None else adjust(loss)
                scale_loss(loss).backward()
            total += loss.detach()
            sums += pair_sums(out, chosen, rejected)
        self.last = {k: v for k, v in agreed(sums).items() if k not in ("pairs", "loss")}
        return total

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batches: list, contexts: MicroBatchContext) -> tuple[float, int]:
        """(mean pair loss, pairs) over every rank's held-out pairs; the pair metrics go to `last_eval`."""
        sums = torch.zeros(len(STATS), dtype=torch.float64, device=contexts.device)
        for batch in batches:
            inputs, targets = (t.to(contexts.device) for t in batch)
            with contexts.autocast():
                sums += pair_sums(*self.pair_losses(model, inputs, targets))
        self.last_eval = agreed(sums)
        return self.last_eval["loss"], int(round(float(self.last_eval["pairs"])))

    def eval_metrics(self) -> dict[str, float]:
        """The last evaluation's pair metrics (core/objectives.PAIR_METRICS), for its eval record."""
        return {k: v for k, v in self.last_eval.items() if k in objectives.PAIR_METRICS}


def pair_sums(out: losses.PairLosses, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """One micro-batch's sums in STATS' order (agreed() turns them into means over the pairs)."""
    chosen_r, rejected_r = out.chosen_rewards, out.rejected_rewards
    values = [torch.tensor(float(out.losses.numel()), device=chosen.device), out.losses.detach().sum(),
              (chosen_r > rejected_r).sum(), (chosen_r - rejected_r).sum(), chosen_r.sum(), rejected_r.sum(),
              chosen.sum(), rejected.sum()]
    return torch.stack([v.double() for v in values])


def agreed(sums: torch.Tensor) -> dict[str, float]:
    """Each metric's mean over the pairs of every rank. Ranks that share pairs (tp) add equal copies to every sum
    and to the count: the means are unchanged."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sums)
    values = sums.tolist()
    pairs = max(values[0], 1.0)
    return {"pairs": values[0], **{name: v / pairs for name, v in zip(STATS[1:], values[1:], strict=True)}}
