"""Mixture-of-experts keys: on a dense family, more experts per token than experts, and the layouts and adapters
the MoE families do not implement (tp with a capacity, ep with both tp and pp; LoRA on a dense MLP they lack, on
experts a dense model lacks, or on experts in what peft cannot say): each one line, exit 2, nothing launched.
Pipeline stages and ep with tp they run (ep's own refusals: hostile/experts.py)."""

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


@case("moe", "tp with a capacity, ep with tp and pp, LoRA on a dense MLP of an MoE family; pp and ep x tp planned")
def _(p: Probe) -> None:
    refused(p.cli(*MOE, "sharding=none", "sharding.tp=2", "model.moe.capacity_factor=1.5"),
            "model.moe.capacity_factor=1.5", "sharding.tp=2", "capacity_factor=0")
    refused(p.cli(*MOE, "cluster.procs_per_node=8", "sharding=fsdp", "sharding.dp_shard=2", "sharding.tp=2",
                  "sharding.pp=2", "sharding.ep=2", "train.micro_batch=4", "train.grad_accum=2"),
            "sharding.ep=2", "sharding.tp=2", "sharding.pp=2", "ep with tp or ep with pp")
    succeeded(p.cli(*MOE, "cluster.procs_per_node=4", "sharding=fsdp", "sharding.dp_shard=2", "sharding.tp=2",
                    "sharding.ep=2"), "experts (ep=2)")
    succeeded(p.cli(*MOE, "sharding=none", "sharding.pp=2"), "pp rank 1")
    refused(p.cli(*MOE, "model.lora.rank=4", "model.lora.targets=[q,gate]"), "model.lora.targets", "attention",
            "expert_gate_up")


@case("moe", "LoRA on the experts: on a dense model, split gate/up, with dropout or nf4 refused; planned on an MoE")
def _(p: Probe) -> None:
    lora = ("model.lora.rank=4", "model.lora.targets=[q,expert_gate_up,expert_down]")
    refused(p.cli(*TINY, *lora), "model.lora.targets", "no expert_gate_up", "qwen3_moe")
    refused(p.cli(*MOE, "model.lora.rank=4", "model.lora.targets=[expert_gate,expert_up]"), "unknown expert_gate",
            "expert_gate_up")
    refused(p.cli(*MOE, *lora, "model.lora.dropout=0.1"), "model.lora.dropout=0.1", "model.lora.dropout=0")
    refused(p.cli(*MOE, *lora, "model.lora.base_dtype=nf4"), "model.lora.base_dtype=nf4", "fp32")
    refused(p.cli(*MOE, "model.lora.rank=4", "model.lora.targets=expert_down"), "model.lora.targets")
    succeeded(p.cli(*MOE, *lora, "cluster.procs_per_node=2", "sharding=fsdp", "sharding.ep=2"), "LoRA rank 4")


@case("moe", "export of a run that routes through an aux-loss-free bias (no place for it in the HF class)")
def _(p: Probe) -> None:
    succeeded(p.cli("launch", "--dry-run", *TINY[1:], "model=qwen3_moe_tiny", "model.moe.bias_update_rate=0.01",
                    "--name", "run"))
    before = p.files()
    refused(p.cli("export", "run", timeout=120), "model.moe.bias_update_rate=0.01", "bias_update_rate=0")
    nothing_left(p, before)
