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


def test_layouts_that_split_a_pair_are_refused_naming_what_works():
    for key in ("pp", "cp"):
        (line,) = objectives.unsupported("dpo", replace(ShardingConfig(), **{key: 2}))
        assert f"sharding.{key}=2" in line and "fsdp" in line
    assert objectives.unsupported("sft", replace(ShardingConfig(), pp=2)) == []
