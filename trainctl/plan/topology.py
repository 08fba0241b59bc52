"""Parallel degrees: one view of how the world is split.

dp_replicate x dp_shard x cp x tp x pp = world size, with -1 meaning "infer".
Pure Python: used by the launcher to validate before launch and by the worker
to build its DeviceMesh from the already-resolved degrees.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainctl.config.schema import ShardingConfig

# Strategies that replicate parameters across data-parallel ranks vs shard them.
REPLICATED = ("ddp", "zero1")
SHARDED = ("zero2", "zero3", "fsdp")


@dataclass(frozen=True)
class ParallelDims:
    """Resolved parallel degrees (all >= 1)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches are processed at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    def as_dict(self) -> dict:
        return {
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "cp": self.cp,
            "tp": self.tp,
            "pp": self.pp,
        }


def _strategy_constraints(s: ShardingConfig) -> list[str]:
    """Problems with the degrees a strategy allows, before any inference."""
    problems = []
    if s.strategy == "none":
        if (s.dp_replicate, s.dp_shard) != (1, 1):
            problems.append("sharding.strategy=none needs dp_replicate=1 and dp_shard=1; choose sharding=ddp or sharding=fsdp for data parallelism")
    elif s.strategy in REPLICATED and s.dp_shard != 1:
        problems.append(f"sharding.dp_shard={s.dp_shard}: strategy {s.strategy} replicates parameters, so dp_shard must be 1 (use sharding=hsdp to combine both)")
    elif s.strategy in SHARDED and s.dp_replicate != 1:
        problems.append(f"sharding.dp_replicate={s.dp_replicate}: strategy {s.strategy} shards within one group, so dp_replicate must be 1 (use sharding=hsdp to combine both)")
    return problems


def infer_dims(s: ShardingConfig, world_size: int) -> tuple[ParallelDims | None, list[str]]:
    """Resolve -1 degrees against `world_size`; returns (dims, problems)."""
    problems = _strategy_constraints(s)
    named = {"dp_replicate": s.dp_replicate, "dp_shard": s.dp_shard, "cp": s.cp, "tp": s.tp, "pp": s.pp}
    for key, value in named.items():
        if value == 0 or value < -1:
            problems.append(f"sharding.{key}={value}: a degree must be a positive integer, or -1 to infer it from the world size")
    if problems:
        return None, problems

    unknown = [k for k, v in named.items() if v == -1]
    known = 1
    for v in named.values():
        if v != -1:
            known *= v
    if len(unknown) > 1:
        keys = ", ".join(f"sharding.{k}" for k in unknown)
        return None, [f"{keys} are all -1: at most one degree can be inferred; set the others explicitly"]
    if unknown:
        if world_size % known:
            return None, [
                f"sharding.{unknown[0]}=-1: world size {world_size} is not divisible by the product of the other degrees ({known}); "
                f"change cluster.nodes x cluster.procs_per_node to a multiple of {known}"
            ]
        named[unknown[0]] = world_size // known
    dims = ParallelDims(**named)
    if dims.world_size != world_size:
        return None, [
            f"sharding degrees {dims.as_dict()} multiply to {dims.world_size} but the world size is {world_size} "
            f"(cluster.nodes x cluster.procs_per_node); set one degree to -1 to infer it"
        ]
    return dims, []
