"""`trainctl eval --data PAIRS` on a preference run: the pair metrics of held-out pairs, the paper's formulas
written out here on the same model; full-weight DPO (no stored reference) and SFT runs refused in one line."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch

from tests.helpers import rounding_rel
from tests.unit.test_preference_loss import TINY, pair_batches, preference_set
from trainctl.config.schema import LoRAConfig, RunConfig, TrainConfig
from trainctl.core.tool_options import EvalResult
from trainctl.models.build import build_model
from trainctl.models.loss_head import IGNORE_INDEX
from trainctl.train.evaluate_pairs import pair_metrics, refusal

MICRO, SEQ_LEN = 8, 64


def run_config(objective: str, rank: int) -> RunConfig:
    train = TrainConfig(objective=objective, dpo_beta=0.5, micro_batch=MICRO, global_batch=MICRO, seq_len=SEQ_LEN)
    return RunConfig(model=replace(TINY, lora=LoRAConfig(rank=rank)), train=train)


def lora_model(cfg: RunConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(cfg.model, "cpu")
    model.init_weights()
    for name, param in model.named_parameters():
        if "lora_b" in name:
            torch.nn.init.normal_(param.data, std=0.5)  # trained adapters: the policy differs from its base
    return model.eval()


def summed_logps(model, inputs, targets) -> torch.Tensor:
    logps = torch.log_softmax(model(inputs).float(), -1)
    picked = logps.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * (targets != IGNORE_INDEX)).sum(-1)


@pytest.mark.parametrize("objective", ["dpo", "simpo"])
def test_pair_metrics_follow_the_papers_formulas(tmp_path, objective):
    data = preference_set(tmp_path, pairs=60)
    cfg = run_config(objective, rank=4)
    model = lora_model(cfg)
    base = copy.deepcopy(model)
    for m in base.modules():
        if hasattr(m, "lora_b"):
            m.lora_b.data.zero_()  # the base: what DPO's reference is
    got = pair_metrics(cfg, lambda: (model, torch.device("cpu")), str(data), "val", 256, batches=2, full=False)
    wins, margins, losses, scale = [], [], [], 0.0
    with torch.no_grad():
        for inputs, targets in pair_batches(data, "val", micro=MICRO).eval_batches(2):
            logps = summed_logps(model, inputs, targets)
            scale = max(scale, float(logps.abs().max()))
            if objective == "dpo":
                rewards = 0.5 * (logps - summed_logps(base, inputs, targets))
                gamma = 0.0
            else:
                rewards = cfg.train.simpo_beta * logps / (targets != IGNORE_INDEX).sum(-1)
                gamma = cfg.train.simpo_gamma
            chosen, rejected = rewards[:MICRO], rewards[MICRO:]
            wins += (chosen > rejected).tolist()
            margins += (chosen - rejected).tolist()
            losses += [math.log1p(math.exp(-(m - gamma))) for m in (chosen - rejected).tolist()]
    assert got["pairs"] == 2 * MICRO and got["batches"] == 2 and got["objective"] == objective
    assert got["reward_accuracy"] == sum(wins) / len(wins)
    # Each reward: fp32 log-softmax over the vocabulary, summed over the row's targets, relative to the largest
    # summed log-probability; a margin adds four such sums (policy and reference, chosen and rejected).
    beta = cfg.train.dpo_beta if objective == "dpo" else cfg.train.simpo_beta
    tol = 4 * beta * scale * rounding_rel(torch.float32, SEQ_LEN + TINY.vocab_size)
    assert got["reward_margin"] == pytest.approx(sum(margins) / len(margins), abs=tol)
    assert got["loss"] == pytest.approx(sum(losses) / len(losses), abs=tol)  # log-sigmoid: 1-Lipschitz
    assert any(abs(m) > 10 * tol for m in margins)  # the rewards were not all zero: the checks compared something


def test_a_full_pass_reads_every_pair_once(tmp_path):
    data = preference_set(tmp_path, pairs=60)
    cfg = run_config("simpo", rank=0)
    model = lora_model(cfg)
    pairs = len(pair_batches(data, "val", micro=MICRO).pairs)
    got = pair_metrics(cfg, lambda: (model, torch.device("cpu")), str(data), "val", 256, batches=1, full=True)
    assert got["pairs"] == pairs and got["batches"] == -(-pairs // MICRO)


def test_runs_without_a_reference_or_a_pair_objective_are_refused():
    assert refusal(run_config("dpo", rank=4), "p") is None and refusal(run_config("simpo", rank=0), "p") is None
    full = refusal(run_config("dpo", rank=0), "p")
    assert full.startswith("--data p: a full-weight DPO run's reference") and "model.lora.rank > 0" in full
    assert "train.objective=sft" in refusal(run_config("sft", rank=0), "p")


def test_the_result_line_names_the_pair_metrics():
    pairs = {"objective": "dpo", "pairs": 32, "loss": 0.25, "reward_accuracy": 0.96875, "reward_margin": 2.5,
             "reward_chosen": 1.0, "reward_rejected": -1.5}
    result = EvalResult(loss=None, perplexity=None, tokens=0, batches=4, seq_len=64, micro_batch=8, step=20,
                        checkpoint="c", data="/d", pairs=pairs)
    assert result.text() == ("step 20: val pairs 32 (4 batches of 8 pairs x 64) of /d: dpo loss 0.2500, accuracy "
                             "96.9%, margin 2.5 (chosen 1, rejected -1.5)")
