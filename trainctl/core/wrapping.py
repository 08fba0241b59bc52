"""The wrapping decision: what the worker wraps the model with, decided once, without torch.

`wrapping(strategy, dims, precision)` is read by the worker (train/parallel/parallelize.py, precision.py,
float8.py) to wrap the model, and by the plan (memory, throughput, notes) and validation to count
and check what that wrapping costs. Neither side restates the conditions below.

    strategy   tp = pp = 1                     tp > 1 or pp > 1
    none       nothing                         nothing
    ddp        torch DDP                       FSDP2 on a shard group of one over dp_replicate ("FSDP2 as DDP":
                                               DDP cannot bucket DTensors; a schedule breaks DDP's reducer)
    zero1      torch DDP + ZeroRedundancyOptimizer over dp_replicate (not implemented over tp/pp: core/support.py)
    zero2      FSDP2 over dp_shard, units kept gathered from forward to backward
    zero3      FSDP2 over dp_shard, units resharded after forward (`fsdp` is its alias, resolved by validate)
    hsdp       FSDP2 over dp_replicate x dp_shard, resharded after forward

Precision: FSDP2 (zero2/zero3/hsdp) casts its gathered parameters itself (MixedPrecisionPolicy with the
compute dtype and the reduce dtype); every other wrapping runs forward and loss under torch.autocast.
FSDP2 as DDP keeps fp32 parameters (its precision is autocast's, as DDP's).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainctl.core.dims import ParallelDims

# What sharding.strategy may name (config/schema.py's choices), in the order errors list them.
STRATEGIES = ("none", "ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp")
# Input spellings validate turns into another strategy; nothing after validation sees them.
ALIASES = {"fsdp": "zero3"}
# Parameters replicated on every data-parallel rank (dp_shard must be 1).
REPLICATING = ("ddp", "zero1")
# Parameters sharded by FSDP2 over dp_shard (and replicated over dp_replicate under hsdp).
FSDP2 = ("zero2", "zero3", "hsdp")
# Sharded within one group (dp_replicate must be 1).
SHARDING_WITHIN_GROUP = ("zero2", "zero3")
# Units that reshard after forward (zero2 keeps them gathered until their backward).
RESHARDING = ("zero3", "hsdp")


def canonical(strategy: str) -> str:
    """The strategy an input spelling means (`fsdp` -> `zero3`); unknown names pass through for validate."""
    return ALIASES.get(strategy, strategy)


def shards_parameters(strategy: str) -> bool:
    """FSDP2 shards the parameters (zero2, zero3 and hsdp): what cpu offload and mixed precision need."""
    return canonical(strategy) in FSDP2


def float8_all_gather(fsdp: bool, precision) -> bool:
    """FSDP2 gathers float8 weights: torchao supports it for the tensorwise recipe only."""
    return fsdp and precision is not None and precision.fp8 and precision.fp8_recipe == "tensorwise"


@dataclass(frozen=True)
class Wrapping:
    """What the worker wraps one model (or pipeline stage) with."""

    fsdp: bool  # FSDP2 fully_shard sharding parameters over the dp mesh (embedding, each block, head, root)
    fsdp_as_ddp: bool  # FSDP2 on a shard group of one over dp_replicate (each block, root): ddp over tp or pp
    ddp: bool  # torch DistributedDataParallel around the whole model
    zero1: bool  # ZeroRedundancyOptimizer over dp_replicate (gradients by DDP)
    reshard_after_forward: bool  # FSDP2's embedding and blocks; the head and root never reshard
    autocast: bool  # torch.autocast in the compute dtype around forward and loss
    param_dtype: str | None  # FSDP2 MixedPrecisionPolicy's param dtype; None: no policy (fp32)
    reduce_dtype: str | None  # FSDP2 MixedPrecisionPolicy's reduce dtype; None: no policy (fp32)
    float8_all_gather: bool  # FSDP2 gathers float8 weights (torchao, tensorwise recipe only)
    dp_mesh: tuple[str, ...]  # mesh dims data parallelism reduces over (before cp joins them)

    @property
    def fully_shard(self) -> bool:
        """Some FSDP2 units exist (sharding or not): gathers, units and no-sync accumulation apply."""
        return self.fsdp or self.fsdp_as_ddp

    @property
    def mixed_precision(self) -> bool:
        """FSDP2 casts parameters to a lower compute dtype (MixedPrecisionPolicy), instead of autocast."""
        return self.param_dtype is not None

    @property
    def all_reduces_over_replicas(self) -> bool:
        """Gradients are all-reduced over dp_replicate (DDP, zero1, FSDP2 as DDP, hsdp)."""
        return "dp_replicate" in self.dp_mesh


def dp_mesh_dims(strategy: str) -> tuple[str, ...]:
    """The mesh dims a strategy's data parallelism spans."""
    if strategy in REPLICATING:
        return ("dp_replicate",)
    if strategy == "hsdp":
        return ("dp_replicate", "dp_shard")
    if strategy in SHARDING_WITHIN_GROUP:
        return ("dp_shard",)
    return ()


def wrapping(strategy: str, dims: ParallelDims, precision=None) -> Wrapping:
    """The decision (module doc) for a validated strategy, resolved degrees and config.schema's PrecisionConfig.

    Without `precision` (what holds the tensors does not depend on it) the run is taken as fp32.
    """
    strategy = canonical(strategy)
    fsdp = strategy in FSDP2
    model_parallel = dims.tp > 1 or dims.pp > 1
    lower = precision is not None and precision.compute_dtype != "fp32"
    mixed = fsdp and lower
    return Wrapping(
        fsdp=fsdp,
        fsdp_as_ddp=strategy == "ddp" and model_parallel,
        ddp=strategy in REPLICATING and not model_parallel,
        zero1=strategy == "zero1",
        reshard_after_forward=strategy in RESHARDING,
        autocast=lower and not fsdp,
        param_dtype=precision.compute_dtype if mixed else None,
        reduce_dtype=precision.reduce_dtype if mixed else None,
        float8_all_gather=float8_all_gather(fsdp, precision),
        dp_mesh=("dp_replicate", "dp_shard") if strategy == "ddp" and model_parallel else dp_mesh_dims(strategy),
    )


def fsdp_shards(wrap: Wrapping, dims: ParallelDims) -> int:
    """Ranks FSDP2 shards parameters over: dp_shard, joined by the cp ranks (the worker's dp_shard_cp mesh: they hold
    the same parameters and see different tokens of the same sequences)."""
    return dims.dp_shard * dims.cp if "dp_shard" in wrap.dp_mesh else dims.dp_shard


def replicas(wrap: Wrapping, dims: ParallelDims) -> int:
    """Ranks gradients are all-reduced over: dp_replicate, joined by the cp ranks where nothing shards (dp_cp)."""
    return dims.dp_replicate * dims.cp if wrap.dp_mesh == ("dp_replicate",) else dims.dp_replicate


def wrapping_of(sharding, precision) -> Wrapping:
    """The decision for a validated config's sharding (resolved degrees) and precision groups."""
    return wrapping(sharding.strategy, ParallelDims.from_config(sharding), precision)
