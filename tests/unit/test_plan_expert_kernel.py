"""The plan says which kernel the routed experts run on CUDA (models/common/experts.py): one grouped matmul for bf16
with widths that are multiples of 8, else a loop of one matmul per expert, naming the key that keeps them off it."""

from __future__ import annotations

import pytest

from trainctl.config.compose import compose
from trainctl.config.validate import resolve
from trainctl.plan import runplan

MOE = ["model=qwen3_moe_tiny", "data=synthetic", "train.seq_len=32", "cluster.device=cuda", "cluster.gpu=h100",
       "cluster.procs_per_node=1", "sharding=none"]


def kernel_notes(*overrides: str) -> list[str]:
    return [n for n in runplan.build(resolve(compose([*MOE, *overrides]))).notes if n.startswith("experts: ")]


def test_bf16_with_aligned_widths_takes_the_grouped_kernel():
    assert kernel_notes("precision=bf16") == [
        "experts: one grouped matmul (torch._grouped_mm) per projection for all of a rank's experts"]


@pytest.mark.parametrize(("overrides", "named"), [
    ((), "precision.compute_dtype=fp32"),
    (("precision=bf16", "model.moe.expert_ffn_dim=100"), "model.moe.expert_ffn_dim=100"),
    (("precision=bf16", "model.lora.rank=6", "model.lora.targets=[q,expert_down]"), "model.lora.rank=6"),
])
def test_what_keeps_the_experts_on_the_loop_is_named(overrides, named):
    (note,) = kernel_notes(*overrides)
    assert note.startswith("experts: a loop of one matmul per expert") and named in note, note


def test_attention_only_lora_and_cpu_runs_say_nothing_of_it():
    # an adapter of rank 6 on attention only: the experts' own widths decide
    assert kernel_notes("precision=bf16", "model.lora.rank=6", "model.lora.targets=[q,v]")[0].startswith(
        "experts: one grouped matmul")
    cpu = [n for n in runplan.build(resolve(compose([*MOE[:3], "cluster.device=cpu"]))).notes
           if n.startswith("experts: ")]
    assert cpu == []
