"""What the trainer asks of preference tuning at setup: which batches, and the objective with its reference."""

from __future__ import annotations

import torch
from torch import nn

from trainctl.config.schema import RunConfig
from trainctl.core import lora, objectives
from trainctl.train.errors import WorkerConfigError
from trainctl.train.loop.data import TokenBatches
from trainctl.train.preference.objective import PreferenceObjective
from trainctl.train.preference.pairs import PairBatches
from trainctl.train.preference.reference import copy_weights, frozen_copy


def batches_for(objective: str) -> type:
    """Pairs for a preference objective, windows of tokens otherwise."""
    return PairBatches if objectives.is_preference(objective) else TokenBatches


def build_objective(cfg: RunConfig, model: nn.Module, mesh, device: torch.device,
                    resumed: bool) -> PreferenceObjective | None:
    """None for SFT (the loop's own loss); a preference objective with DPO's reference otherwise.

    The frozen reference (DPO without LoRA) starts as the policy's weights on a fresh run (called after they were
    loaded); a resumed run rebuilds the starting weights: the seeded init, then checkpoint.init_from's.
    """
    if not objectives.is_preference(cfg.train.objective):
        return None
    refused = objectives.unsupported(cfg.train.objective, cfg.sharding)  # a hand-edited config.yaml meets it here
    if refused:
        raise WorkerConfigError("; ".join(refused))
    reference = None
    if objectives.cost(cfg.train.objective, lora.enabled(cfg.model.lora)).reference_weights:
        reference = frozen_copy(cfg, mesh, device)
        if not resumed:
            copy_weights(reference, model)
        elif cfg.checkpoint.init_from:
            from trainctl.models.hf import load_hf_weights

            load_hf_weights(reference, cfg.checkpoint.init_from, cfg.model)
    return PreferenceObjective(cfg.train, reference)
