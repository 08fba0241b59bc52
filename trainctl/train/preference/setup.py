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


def truncation_warning(seq_len: int, *batches) -> str | None:
    """One line for the whole run's pair data (every split): how many pairs train.seq_len cuts, how many it
    leaves without an answer token (dropped); None when it cuts none, or for token windows."""
    tables = [b.pairs for b in batches if isinstance(b, PairBatches)]
    truncated, dropped = sum(t.truncated for t in tables), sum(t.dropped for t in tables)
    if not truncated:
        return None
    total = sum(len(t) for t in tables) + dropped
    gone = f"; {dropped} of them dropped (an answer kept no token)" if dropped else ""
    return (f"warning: train.seq_len={seq_len} cuts the answers of {truncated} of {total} preference pairs{gone}; "
            "raise train.seq_len to train on whole answers")


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
