"""The training objectives (train.objective), what each costs, and the layouts each runs under; torch-free.

sft     next-token cross-entropy over the counted targets (the loop's own loss, train/loop/loss.py).
dpo     Direct Preference Optimization (Rafailov et al., 2023) on preference pairs: the policy's and a reference
        model's log-probabilities of the chosen and the rejected answer. The reference is computed on the fly:
        with LoRA the same model with its adapters switched off (no second copy of the weights), without LoRA
        a frozen copy of the starting weights, sharded as the policy is.
simpo   SimPO (Meng et al., 2024): reference-free, the length-normalized log-probabilities with a target margin.

Both preference objectives read pairs (data prepared with --format preference): each sample of the global
batch is a pair, two sequences in one micro-batch on one rank. The plan and the worker both read this module,
so what the plan counts (doubled sequences, the reference forward, the reference's weights) is what runs.
"""

from __future__ import annotations

from dataclasses import dataclass

OBJECTIVES = ("sft", "dpo", "simpo")
PREFERENCE = ("dpo", "simpo")
# The pair metrics every preference step logs (train/preference/objective.py) and `trainctl status` shows.
PAIR_METRICS = ("reward_accuracy", "reward_margin", "reward_chosen", "reward_rejected", "logp_chosen",
                "logp_rejected")
# Forward + backward is 3 forwards' worth of FLOPs (backward ~ 2x forward): a reference forward adds 1 to 3.
TRAIN_PASSES = 3


@dataclass(frozen=True)
class Cost:
    """What one objective adds to an SFT step of the same samples."""

    sequences_per_sample: int = 1  # a preference pair is two sequences
    reference_forwards: int = 0  # no-grad forwards of the reference per sequence
    reference_weights: bool = False  # a frozen copy of the model's weights (full fine-tuning DPO)

    @property
    def pass_factor(self) -> float:
        """FLOPs per trained token over SFT's (forward and backward): DPO's reference forward adds one pass."""
        return (TRAIN_PASSES + self.reference_forwards) / TRAIN_PASSES

    @property
    def flops_factor(self) -> float:
        """Step FLOPs over those of SFT on the same number of samples."""
        return self.sequences_per_sample * self.pass_factor


def is_preference(objective: str) -> bool:
    return objective in PREFERENCE


def cost(objective: str, lora_enabled: bool) -> Cost:
    """The objective's extra work (module doc); SFT costs nothing extra."""
    if objective == "dpo":
        return Cost(2, 1, not lora_enabled)
    if objective == "simpo":
        return Cost(2, 0, False)
    return Cost()


def unsupported(objective: str, sharding) -> list[str]:
    """One line per layout a preference objective cannot keep correct: a pipeline hands only hidden states from
    stage to stage (the pair's log-probabilities need the whole sequence's logits on one rank), and context
    parallelism splits each sequence over ranks."""
    if not is_preference(objective):
        return []
    works = "sharding=none, ddp, zero1, zero2, zero3, fsdp or hsdp, with or without sharding.tp"
    return [f"train.objective={objective}: not implemented with sharding.{key}={degree}; use sharding.{key}=1 "
            f"({works})" for key, degree in (("pp", sharding.pp), ("cp", sharding.cp)) if degree > 1]
