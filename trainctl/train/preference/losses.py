"""The preference losses on per-sequence log-probabilities, written as their papers write them.

DPO (Rafailov et al., 2023, eq. 7), with the label smoothing of conservative DPO (Mitchell, 2023; TRL's
`sigmoid` loss): with h = beta * ((log pi(y_w|x) - log pi(y_l|x)) - (log ref(y_w|x) - log ref(y_l|x))),
    loss = -(1 - eps) * log sigmoid(h) - eps * log sigmoid(-h)
and the implicit rewards beta * (log pi(y|x) - log ref(y|x)).

SimPO (Meng et al., 2024, eq. 6): rewards are the length-normalized log-probabilities, no reference:
    loss = -log sigmoid(beta / |y_w| * log pi(y_w|x) - beta / |y_l| * log pi(y_l|x) - gamma)

A sequence's log-probability is the sum over its counted targets (the answer's tokens) of log softmax(logits)
at the target, in fp32 whatever the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trainctl.models.loss_head import IGNORE_INDEX


@dataclass(frozen=True)
class PairLosses:
    """Per-pair losses [pairs] (with gradients) and detached rewards of the chosen and rejected answers."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def sequence_logps(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability of each row's counted targets [rows], how many targets count [rows])."""
    token_logps = -F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), reduction="none",
                                   ignore_index=IGNORE_INDEX).view(targets.shape)
    return token_logps.sum(-1), (targets != IGNORE_INDEX).sum(-1)


def dpo(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
        beta: float, label_smoothing: float = 0.0) -> PairLosses:
    """DPO's per-pair loss from the policy's and the reference's sequence log-probabilities (module doc)."""
    h = beta * ((chosen - rejected) - (ref_chosen - ref_rejected))
    losses = -(1 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)
    return PairLosses(losses, (beta * (chosen - ref_chosen)).detach(), (beta * (rejected - ref_rejected)).detach())


def simpo(chosen: torch.Tensor, rejected: torch.Tensor, chosen_len: torch.Tensor, rejected_len: torch.Tensor,
          beta: float, gamma: float) -> PairLosses:
    """SimPO's per-pair loss from the policy's sequence log-probabilities and answer lengths (module doc)."""
    chosen_rewards = beta * chosen / chosen_len.clamp(min=1)
    rejected_rewards = beta * rejected / rejected_len.clamp(min=1)
    losses = -F.logsigmoid(chosen_rewards - rejected_rewards - gamma)
    return PairLosses(losses, chosen_rewards.detach(), rejected_rewards.detach())
