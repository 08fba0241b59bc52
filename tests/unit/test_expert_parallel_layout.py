"""Validation of sharding.ep (config/layout_check.check_expert_parallel): one line per problem, naming the key."""

from __future__ import annotations

import pytest

from trainctl.config.compose import compose
from trainctl.config.errors import ConfigError
from trainctl.config.validate import resolve

EXPERTS = ["model=qwen3_moe_tiny", "model.moe.num_experts=8"]  # a mixture-of-experts model with 8 experts
MOE = [*EXPERTS, "cluster.procs_per_node=4"]


def _problems(overrides):
    with pytest.raises(ConfigError) as info:
        resolve(compose(overrides))
    return info.value.problems


@pytest.mark.parametrize(("overrides", "fragment"), [
    (["sharding=fsdp", "sharding.ep=2", "cluster.procs_per_node=2"], "model.moe.num_experts=0 is a dense model"),
    (["sharding=fsdp", "sharding.ep=4", *EXPERTS, "model.moe.num_experts=6", "cluster.procs_per_node=4"],
     "does not split evenly over 4 ranks; use an ep that divides it (1, 2, 3, 6)"),
    (["sharding=hsdp", "sharding.ep=4", "sharding.dp_replicate=2", "sharding.dp_shard=2", *MOE],
     "carved from sharding.dp_shard=2 (data-parallel size 4)"),
    (["sharding=ddp", "sharding.ep=2", *MOE], "runs under sharding=zero2, zero3 (fsdp) or hsdp, not strategy ddp"),
    (["sharding=zero1", "sharding.ep=2", *MOE], "not strategy zero1"),
    (["sharding=fsdp", "sharding.ep=2", "sharding.dp_shard=2", "sharding.pp=2", "sharding.pp_stages_per_rank=2",
      "sharding.pp_schedule=interleaved_zero_bubble", *MOE], "use pp_schedule=gpipe, 1f1b or interleaved_1f1b"),
    ([*EXPERTS, "cluster.procs_per_node=8", "sharding=fsdp", "sharding.ep=2", "sharding.dp_shard=2", "sharding.tp=2",
      "sharding.pp=2"], "with both sharding.tp=2 and sharding.pp=2 is not implemented; use ep with tp or ep with pp"),
    (["sharding=fsdp", "sharding.ep=2", "sharding.cpu_offload=true", *MOE], "with sharding.cpu_offload=true"),
    (["sharding=fsdp", "sharding.ep=2", "train.compile=true", *MOE], "with train.compile=true"),
    (["sharding=fsdp", "sharding.ep=0", *MOE], "sharding.ep=0: must be a positive integer"),
])
def test_expert_parallel_refusals(overrides, fragment):
    problems = _problems(overrides)
    matching = [p for p in problems if fragment in p]
    assert matching, problems
    assert all(p.startswith("sharding.ep=") and "\n" not in p for p in matching)


@pytest.mark.parametrize("overrides", [
    ["sharding=fsdp", "sharding.ep=2", *MOE],
    ["sharding=fsdp", "sharding.ep=4", *MOE],
    ["sharding=zero2", "sharding.ep=2", *MOE],
    ["sharding=hsdp", "sharding.ep=2", "sharding.dp_replicate=2", "sharding.dp_shard=2", *MOE],
    ["sharding=ddp", "sharding.ep=1", *MOE],
    ["sharding=fsdp", "sharding.ep=2", "sharding.dp_shard=2", "sharding.tp=2", *MOE],
    ["sharding=fsdp", "sharding.ep=2", "sharding.dp_shard=2", "sharding.pp=2", "sharding.pp_schedule=1f1b",
     "train.grad_accum=2", *MOE],
])
def test_expert_parallel_layouts_that_run(overrides):
    ep = int(overrides[1].removeprefix("sharding.ep="))
    assert resolve(compose(overrides)).sharding.ep == ep
