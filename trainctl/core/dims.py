"""Parallel degrees: one view of how the world is split.

dp_replicate x dp_shard x cp x tp x pp = world size, with -1 meaning "infer".
Pure Python: used by the launcher to validate before launch and by the worker
to build its DeviceMesh from the already-resolved degrees.
"""

from __future__ import annotations

from dataclasses import dataclass

# The five degrees, as config keys (sharding.<name>) and ParallelDims fields.
DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp")
# Mesh dimensions, outermost first: pipeline stages talk least, tensor parallel most.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


class UnresolvedDims(ValueError):
    """Degrees that are not resolved (-1 or 0) or do not cover the world; the message is one line."""


@dataclass(frozen=True)
class ParallelDims:
    """Resolved parallel degrees (all >= 1)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    # expert parallelism: not a sixth factor of the world but a split of dp_shard into [dp_shard/ep, ep]
    ep: int = 1

    @property
    def efsdp(self) -> int:
        """The ranks FSDP2 shards each expert over: dp_shard's ranks that hold the same experts."""
        return self.dp_shard // self.ep

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches are processed at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in DEGREES}

    @classmethod
    def from_config(cls, sharding, world: int | None = None) -> ParallelDims:
        """The resolved degrees of a validated sharding config; UnresolvedDims if one is not, or they miss `world`."""
        degrees = degrees_of(sharding)
        unresolved = [f"sharding.{k}={v}" for k, v in degrees.items() if v < 1]
        if unresolved:
            raise UnresolvedDims(f"{', '.join(unresolved)}: the plan needs resolved degrees; "
                                 "run the config through validate first")
        dims = cls(**degrees, ep=getattr(sharding, "ep", 1))
        if world is not None and dims.world_size != world:
            raise UnresolvedDims(f"sharding degrees {dims.as_dict()} multiply to {dims.world_size}, "
                                 f"not the world size {world}")
        return dims


def degrees_of(sharding) -> dict[str, int]:
    """The five degrees of a sharding config (config.schema.ShardingConfig), by name."""
    return {name: getattr(sharding, name) for name in DEGREES}


def world_size_problem(dims: ParallelDims, world_size: int) -> str | None:
    """One line when resolved degrees do not multiply to the world size (cluster.nodes x cluster.procs_per_node)."""
    if dims.world_size == world_size:
        return None
    return (f"sharding degrees {dims.as_dict()} multiply to {dims.world_size} but the world size is {world_size} "
            f"(cluster.nodes x cluster.procs_per_node); set one degree to -1 to infer it")


def degree_problems(named: dict[str, int]) -> list[str]:
    """One line per degree that is neither positive nor -1."""
    return [f"sharding.{key}={value}: a degree must be a positive integer, or -1 to infer it from the world size"
            for key, value in named.items() if value == 0 or value < -1]


def infer_degrees(named: dict[str, int], world_size: int) -> tuple[ParallelDims | None, list[str]]:
    """Resolve the -1 among `named` degrees against `world_size`; returns (dims, problems)."""
    problems = degree_problems(named)
    if problems:
        return None, problems
    named = dict(named)
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
                f"sharding.{unknown[0]}=-1: world size {world_size} is not divisible by the product of the other "
                f"degrees ({known}); change cluster.nodes x cluster.procs_per_node to a multiple of {known}"
            ]
        named[unknown[0]] = world_size // known
    dims = ParallelDims(**named)
    problem = world_size_problem(dims, world_size)
    return (None, [problem]) if problem else (dims, [])
