"""The plan counts preference tuning (core/objectives.py): a pair's two sequences in the activations, whole logits
(no chunked head), DPO's frozen fp32 reference without LoRA (none with it: the adapters are switched off), and the
step's FLOPs: two sequences a pair, and DPO's reference forward (one forward beside forward + backward's three)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.helpers import LLAMA2_7B
from trainctl.config.schema import LoRAConfig, PrecisionConfig, ShardingConfig, TrainConfig
from trainctl.core import objectives
from trainctl.core.dims import ParallelDims
from trainctl.plan import memory
from trainctl.plan.stages import rank_stages

P = 6_738_415_616  # Llama 2 7B's parameters (tests/unit/test_memory.py counts them by hand)
BF16 = PrecisionConfig(compute_dtype="bf16")
TRAIN = TrainConfig(seq_len=2048, micro_batch=1, grad_accum=1, global_batch=8)


def estimate(objective: str, model=LLAMA2_7B, **degrees) -> memory.RankMemory:
    sharding = ShardingConfig(strategy="fsdp", dp_shard=8)
    train = replace(TRAIN, objective=objective)
    (stage,) = rank_stages(model, sharding, train.grad_accum)[:1]
    return memory.estimate(model, BF16, sharding, train, ParallelDims(dp_shard=8), stage)


def test_a_pair_is_two_sequences_and_dpo_holds_a_sharded_reference():
    sft, dpo, simpo = estimate("sft"), estimate("dpo"), estimate("simpo")
    assert dpo.tokens_per_micro_batch == simpo.tokens_per_micro_batch == 2 * sft.tokens_per_micro_batch
    assert dpo.activations == simpo.activations > sft.activations
    assert sft.reference == simpo.reference == 0 and dpo.reference == 4 * P // 8  # fp32, sharded as the weights
    assert dpo.peak == simpo.peak + dpo.reference
    assert sft.loss_chunk > 0 and dpo.loss_chunk == 0  # whole logits: the pair's log-probs need every row's


def test_with_lora_the_reference_is_the_base_itself():
    lora = replace(LLAMA2_7B, lora=LoRAConfig(rank=8))
    assert estimate("dpo", model=lora).reference == 0
    assert objectives.cost("dpo", lora_enabled=True).reference_forwards == 1  # the forward still runs


@pytest.mark.parametrize("objective,factor", [("sft", 1.0), ("simpo", 2.0), ("dpo", 2 * 4 / 3)])
def test_step_flops_count_the_pairs_and_the_reference_forward(objective, factor):
    assert objectives.cost(objective, lora_enabled=False).flops_factor == pytest.approx(factor, rel=1e-15)
    pairs = 1 if objective == "sft" else 2  # global_batch counts pairs: tokens per step (and tokens/s) both answers
    assert replace(TRAIN, objective=objective).tokens_per_step == pairs * TRAIN.global_batch * TRAIN.seq_len


def test_layouts_that_split_a_pair_are_refused_naming_what_works():
    for key in ("pp", "cp"):
        (line,) = objectives.unsupported("dpo", replace(ShardingConfig(), **{key: 2}))
        assert f"sharding.{key}=2" in line and "fsdp" in line
    assert objectives.unsupported("sft", replace(ShardingConfig(), pp=2)) == []


def test_status_shows_the_last_steps_pair_metrics(tmp_path):
    import io
    import json

    from rich.console import Console

    from tests.helpers import make_run
    from trainctl.api.watching import RunInfo
    from trainctl.render import status_panel
    from trainctl.runs.figures import figures
    from trainctl.runs.registry import run_state

    run_dir = make_run(tmp_path / "runs", "a", launch={"launcher": "local", "exit_code": 0})
    pairs = {"reward_accuracy": 0.975, "reward_margin": 1.25, "reward_chosen": 0.5, "reward_rejected": -0.75,
             "logp_chosen": -12.3, "logp_rejected": -20.1}
    lines = [{"kind": "train", "step": 1, "loss": 0.7, **{k: 0.0 for k in pairs}}, {"kind": "train", "step": 2,
             "loss": 0.5, **pairs}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    info = RunInfo(run_state(run_dir), figures(run_dir))
    assert info.to_dict()["preference"] == pairs
    out = io.StringIO()
    status_panel(Console(file=out, width=200, force_terminal=False), info)
    assert "pairs    accuracy 97.5%, margin 1.25, logp chosen -12.30 rejected -20.10" in out.getvalue()


def test_launch_validation_ties_the_objective_to_preference_data(tmp_path):
    from tests.unit.test_preference_loss import preference_set
    from trainctl.config.compose import compose
    from trainctl.config.errors import ConfigError
    from trainctl.config.validate import resolve

    pairs = preference_set(tmp_path, pairs=40)
    base = ["model=tiny", "data=memmap", f"data.datasets=[{pairs}]", "train.seq_len=64"]
    assert resolve(compose([*base, "train.objective=dpo"])).train.objective == "dpo"
    refusals = {
        "train.objective=sft: ": [],  # SFT on preference pairs would learn the rejected answers too
        "train.objective=dpo: trains on preference pairs": ["train.objective=dpo", "data=synthetic"],
        "sharding.pp=2; use sharding.pp=1": ["train.objective=simpo", "sharding.pp=2", "cluster.procs_per_node=2",
                                             "train.global_batch=4", "train.micro_batch=1"],
        "data.document_mask=true: train.objective=dpo": ["train.objective=dpo", "data.document_mask=true"],
        "checkpoint.resume=/elsewhere: train.objective=dpo without LoRA": ["train.objective=dpo",
                                                                          "checkpoint.resume=/elsewhere"],
    }
    for words, extra in refusals.items():
        overrides = base + extra if "data=synthetic" not in extra else ["model=tiny", *extra]
        with pytest.raises(ConfigError) as refused:
            resolve(compose(overrides))
        assert any(words in line for line in refused.value.problems), (words, refused.value.problems)
