"""`trainctl eval --data PAIRS` on a preference run: its checkpoint's pair metrics over a preference dataset's split.

The worker's own pieces: PairBatches' held-out pairs (the same fixed draw as the run's eval records, or every
pair in order with --all) and PreferenceObjective's pair losses and metrics (reward accuracy and margin, the
rewards, the answers' log-probabilities), in fp32 on one device. SimPO needs no reference; DPO with LoRA
takes the checkpoint's model with its adapters switched off, as the run did. Full-weight DPO's reference is its
starting weights, which no checkpoint stores: refused in one line.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from trainctl.config.schema import DataConfig, RunConfig
from trainctl.core import lora, objectives
from trainctl.core.errors import UserError
from trainctl.train.loop.sources import DataError
from trainctl.train.preference.objective import PreferenceObjective, agreed, pair_sums
from trainctl.train.preference.pairs import PairBatches


def refusal(cfg: RunConfig, data: str) -> str | None:
    """Why this run's pair metrics cannot be computed here, in one line; None when they can."""
    objective = cfg.train.objective
    if not objectives.is_preference(objective):
        return (f"--data {data}: holds preference pairs and the run trained with train.objective={objective}; "
                "evaluate a dpo or simpo run on it, or an SFT run on text or chat data")
    if objectives.cost(objective, lora.enabled(cfg.model.lora)).reference_weights:
        return (f"--data {data}: a full-weight DPO run's reference is its starting weights, which its checkpoints "
                "do not hold; pair metrics are evaluated for train.objective=simpo or DPO with model.lora.rank > 0 "
                "(the run's eval records carry its held-out pair metrics)")
    return None


def pair_batches(cfg: RunConfig, data_dir: str, split: str, vocab_size: int, batches: int, full: bool
                 ) -> tuple[list, int]:
    """(the micro-batches of pairs, their count): the run's fixed held-out draw, or every pair once in order."""
    data = DataConfig(kind="memmap", datasets=[data_dir], vocab_size=vocab_size)
    micro = cfg.train.micro_batch
    source = PairBatches(data, split, cfg.train.seq_len, micro, micro, 1, 0, 1, seed=0)
    chosen = source.full_pass() if full else source.eval_batches(batches)
    return chosen, len(chosen)


@torch.no_grad()
def pair_metrics(cfg: RunConfig, model: Callable, data_dir: str, split: str, vocab_size: int, batches: int,
                 full: bool) -> dict:
    """EvalResult.pairs: {pairs, loss, PAIR_METRICS...} (means over the pairs) and the batches read."""
    try:
        chosen, count = pair_batches(cfg, data_dir, split, vocab_size, batches, full)
    except DataError as exc:
        raise UserError([f"--data {exc}"]) from None
    module, device = model()
    objective = PreferenceObjective(cfg.train)  # reference None: DPO's is the model with its adapters off
    sums = None
    for inputs, targets in chosen:
        out = pair_sums(*objective.pair_losses(module, inputs.to(device), targets.to(device)))
        sums = out if sums is None else sums + out
    metrics = agreed(sums)  # one process: the means over the pairs read
    metrics["pairs"] = int(round(metrics["pairs"]))
    return {"objective": cfg.train.objective, **metrics, "batches": count}
