"""Mixture-of-experts keys: on a dense family, more experts per token than experts, and the layouts and adapters
the MoE families do not implement (tp with a capacity or with ep, LoRA on the experts): each one line, exit 2,
nothing launched. Pipeline stages they run (ep with pp is refused by ep's own check: hostile/experts.py)."""

from __future__ import annotations

from hostile.common import Probe, case, nothing_left, refused, succeeded

TINY = ("plan", "recipe=tiny_cpu")
MOE = (*TINY, "model=qwen3_moe_tiny")


@case("moe", "model.moe keys on a dense family: refused naming the MoE families")
def _(p: Probe) -> None:
    refused(p.cli(*TINY, "model.moe.num_experts=8"), "model.moe.num_experts=8", "dense", "qwen3_moe")
    refused(p.cli(*TINY, "model.moe.aux_loss_coef=0.5"), "model.moe.aux_loss_coef", "dense")


@case("moe", "more experts per token than experts, and an MoE family without experts")
def _(p: Probe) -> None:
    refused(p.cli(*MOE, "model.moe.experts_per_token=9"), "model.moe.experts_per_token=9", "at most 4")
    refused(p.cli(*MOE, "model.moe.num_experts=0"), "model.moe.num_experts=0", "mixture of experts")


@case("moe", "tp with a capacity or with ep and LoRA on the experts of an MoE family; pipeline stages planned")
def _(p: Probe) -> None:
    refused(p.cli(*MOE, "sharding=none", "sharding.tp=2", "model.moe.capacity_factor=1.5"),
            "model.moe.capacity_factor=1.5", "sharding.tp=2", "capacity_factor=0")
    refused(p.cli(*MOE, "cluster.procs_per_node=4", "sharding=fsdp", "sharding.dp_shard=2", "sharding.tp=2",
                  "sharding.ep=2"), "sharding.ep=2", "sharding.tp=2", "not implemented")
    succeeded(p.cli(*MOE, "sharding=none", "sharding.pp=2"), "pp rank 1")
    refused(p.cli(*MOE, "model.lora.rank=4", "model.lora.targets=[q,gate]"), "model.lora.targets", "attention")


@case("moe", "export of a run that routes through an aux-loss-free bias (no place for it in the HF class)")
def _(p: Probe) -> None:
    succeeded(p.cli("launch", "--dry-run", *TINY[1:], "model=qwen3_moe_tiny", "model.moe.bias_update_rate=0.01",
                    "--name", "run"))
    before = p.files()
    refused(p.cli("export", "run", timeout=120), "model.moe.bias_update_rate=0.01", "bias_update_rate=0")
    nothing_left(p, before)
