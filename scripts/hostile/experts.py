"""Expert parallelism (sharding.ep) asked of layouts it cannot split: each one line, exit 2, no run directory."""

from __future__ import annotations

from hostile.common import Probe, case, expect, nothing_left, refused
from trainctl.models import registry

LAUNCH = ["launch", "--dry-run", "recipe=tiny_cpu", "runs_dir=r", "cluster.procs_per_node=4", "train.micro_batch=2"]
# 8 experts: the qwen3_moe family where it is registered (a dense family refuses experts there), else model.moe alone
MOE = (["model=qwen3_moe_tiny"] if "qwen3_moe" in registry.names() else []) + ["model.moe.num_experts=8"]

# A mixture-of-experts family may refuse the same layout for its own reason (its own line): only ep's line is judged.
for _name, _extra, _words in [
    ("ep>1 on a dense model", ["sharding=fsdp", "sharding.ep=2"], ("sharding.ep=2", "num_experts=0", "ep=1")),
    ("experts that do not split over ep", ["sharding=fsdp", "sharding.ep=4", *MOE, "model.moe.num_experts=6"],
     ("sharding.ep=4", "num_experts=6", "1, 2, 3, 6")),
    ("ep that does not divide dp_shard",
     ["sharding=hsdp", "sharding.dp_replicate=2", "sharding.dp_shard=2", "sharding.ep=4", *MOE],
     ("sharding.ep=4", "dp_shard=2", "divides dp_shard")),
    ("ep under ddp", ["sharding=ddp", "sharding.ep=2", *MOE], ("sharding.ep=2", "zero2", "hsdp", "ddp")),
    ("ep with the zero-bubble pipeline schedule",
     ["sharding=fsdp", "sharding.pp=2", "sharding.pp_schedule=interleaved_zero_bubble", "sharding.ep=2", *MOE],
     ("sharding.ep=2", "interleaved_zero_bubble", "1f1b")),
    ("ep with both tp and pp", ["sharding=fsdp", "cluster.procs_per_node=8", "sharding.tp=2", "sharding.pp=2",
                                "sharding.ep=2", *MOE], ("sharding.ep=2", "tp=2", "pp=2", "ep with tp or ep with pp")),
    ("ep=-1 (no inference for ep)", ["sharding=fsdp", "sharding.ep=-1", *MOE], ("sharding.ep=-1", "positive")),
]:
    def _check(p: Probe, extra=_extra, words=_words) -> None:
        before = p.files()
        r = p.cli(*LAUNCH, *extra)
        refused(r, *words, one_line=False)
        ep_lines = [line for line in r.lines if line.startswith("error: sharding.ep=")]
        expect(len(ep_lines) == 1, "wrong", f"{len(ep_lines)} sharding.ep lines for one problem: {ep_lines[:3]}")
        nothing_left(p, before, p.tmp / "r")

    case("ep", _name)(_check)
