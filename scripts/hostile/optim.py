"""Optimizer choices and their hyperparameters: values out of range, and optimizers the model or layout cannot use."""

from __future__ import annotations

from hostile.common import Probe, case, refused

TINY = ("plan", "recipe=tiny_cpu")


@case("optim", "a learning rate of 0, below 0, or nan")
def _(p: Probe) -> None:
    for value in ("0", "-1e-3", "nan"):
        refused(p.cli(*TINY, f"optim.lr={value}"), "optim.lr=")


@case("optim", "betas outside (0, 1): 0, 1, 1.5 and below 0")
def _(p: Probe) -> None:
    for override in ("optim.beta1=0", "optim.beta1=1.0", "optim.beta2=1.5", "optim.beta2=-0.1"):
        refused(p.cli(*TINY, "optim=lion", override), override.split("=")[0])


@case("optim", "Muon on a model whose every trainable matrix it excludes (rank-1 LoRA factors)")
def _(p: Probe) -> None:
    refused(p.cli(*TINY, "optim=muon", "model.lora.rank=1"), "optim.name=muon", "hidden matrix", "adamw")


@case("optim", "8-bit AdamW on a model with no tensor large enough to quantize")
def _(p: Probe) -> None:
    small = ("model.dim=8", "model.n_heads=2", "model.n_kv_heads=2", "model.ffn_dim=16")
    refused(p.cli(*TINY, "optim=adamw8bit", *small), "optim.name=adamw8bit", "quantize", "4096")


@case("optim", "a quantized optimizer under zero1, FSDP2 or tp, Muon under zero1: refused naming what works")
def _(p: Probe) -> None:
    refused(p.cli(*TINY, "optim=adamw8bit", "sharding=zero1"), "optim.name=adamw8bit", "zero1", "sharding=ddp")
    refused(p.cli(*TINY, "optim=adamw8bit", "sharding=zero3"), "optim.name=adamw8bit", "DTensor", "ddp")
    refused(p.cli(*TINY, "optim=adamw8bit", "sharding.tp=2", "cluster.procs_per_node=2"), "optim.name=adamw8bit",
            "sharding.tp=2", "ddp")
    refused(p.cli(*TINY, "optim=muon", "sharding=zero1"), "optim.name=muon", "zero1", "sharding=ddp")
