"""Per-rank memory of the model states (weights, gradients, AdamW states), without torch.

The ZeRO arithmetic, for P parameters split by tensor and pipeline parallelism
(P_mp ~ P / (tp * pp)) and AdamW in fp32:

    strategy           weights      grads        optimizer
    none, ddp          4 P_mp       4 P_mp       8 P_mp
    zero1              4 P_mp       4 P_mp       8 P_mp / dp
    zero2              4 P_mp       4 P_mp / dp  8 P_mp / dp
    zero3, fsdp, hsdp  4 P_mp / S   4 P_mp / S   8 P_mp / S      (S = dp_shard)

HSDP shards within a group of dp_shard ranks and replicates across dp_replicate
groups, so only dp_shard divides. Assumptions, stated once:
- Master weights, gradients and both AdamW moments are fp32 whatever the compute
  dtype (FSDP2's MixedPrecisionPolicy keeps the sharded parameters fp32, and
  gradients land in the parameters' dtype).
- The tp * pp split is even; in reality norms are replicated across TP ranks and
  the embedding/output sit on the first/last pipeline stage, so the busiest rank
  holds slightly more.
- `compute_copy` is what the forward/backward needs on top of the master
  weights: for parameter-sharding strategies, the all-gathered units (the
  current block plus the one being prefetched) in the compute dtype; for
  replicated strategies under bf16/fp16 autocast, a compute-dtype copy of the
  whole model (autocast caches the casts and autograd saves them for backward).
- cpu_offload (FSDP2's CPUOffloadPolicy) moves weights, gradients and optimizer
  states to host memory; the device keeps only the gathered compute units.
- Activations are NOT estimated here (a later issue): `total` is the model-state
  memory only, so a config can still run out of memory when `total` fits.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from trainctl.config.schema import ModelConfig, PrecisionConfig, ShardingConfig
from trainctl.plan.flops import embedding_params, layer_params, param_count
from trainctl.plan.hardware import GPUS
from trainctl.plan.topology import ParallelDims

FP32_BYTES = 4
ADAMW_STATE_BYTES = 8  # exp_avg + exp_avg_sq, fp32 each
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
GIB = 2**30

# Strategies whose parameters are sharded (FSDP2 fully_shard): weights are all-gathered per unit.
PARAM_SHARDING = ("zero3", "fsdp", "hsdp")
# How many units are all-gathered at once at peak: the running block and the prefetched next one.
GATHERED_UNITS = 2


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank. Device memory is weights + grads + optimizer + compute_copy; activations excluded."""

    weights: int
    grads: int
    optimizer: int
    compute_copy: int
    host: int  # moved to host memory by cpu_offload; not part of `total`

    @property
    def total(self) -> int:
        """Device bytes for the model states (no activations)."""
        return self.weights + self.grads + self.optimizer + self.compute_copy

    def to_dict(self) -> dict:
        """Every field and the total, keys suffixed `_bytes` (the plan renderer shows those as GiB)."""
        return {f"{k}_bytes": v for k, v in {**asdict(self), "total": self.total}.items()}


def _ceil_div(n: int, d: int) -> int:
    return -(-n // d)


def model_parallel_params(model: ModelConfig, dims: ParallelDims) -> int:
    """Parameters held by one tensor/pipeline-parallel rank, assuming an even split (rounded up)."""
    return _ceil_div(param_count(model), dims.tp * dims.pp)


def state_divisors(strategy: str, dims: ParallelDims) -> tuple[int, int, int]:
    """How many ranks share (weights, grads, optimizer states) under a strategy."""
    if strategy in ("none", "ddp"):
        return 1, 1, 1
    if strategy == "zero1":
        return 1, 1, dims.dp
    if strategy == "zero2":
        return 1, dims.dp, dims.dp
    if strategy in PARAM_SHARDING:
        return dims.dp_shard, dims.dp_shard, dims.dp_shard
    raise AssertionError(f"unknown sharding strategy {strategy!r}: validate should have rejected it")


def compute_copy_bytes(model: ModelConfig, precision: PrecisionConfig, strategy: str, dims: ParallelDims) -> int:
    """Bytes of parameters materialized for compute beyond the fp32 master weights (see module doc)."""
    dtype_bytes = DTYPE_BYTES[precision.compute_dtype]
    if strategy in PARAM_SHARDING:
        # FSDP2 wraps each block, and the embedding and output separately; the largest unit bounds one gather.
        unit = max(layer_params(model), embedding_params(model)) // dims.tp
        return GATHERED_UNITS * unit * dtype_bytes
    if precision.compute_dtype == "fp32":
        return 0  # the replicated fp32 master weights are used directly
    return model_parallel_params(model, dims) * dtype_bytes


def estimate(model: ModelConfig, precision: PrecisionConfig, sharding: ShardingConfig, dims: ParallelDims) -> MemoryEstimate:
    """Per-rank model-state memory for a resolved layout (assumptions in the module docstring)."""
    p_mp = model_parallel_params(model, dims)
    w_div, g_div, o_div = state_divisors(sharding.strategy, dims)
    weights = _ceil_div(FP32_BYTES * p_mp, w_div)
    grads = _ceil_div(FP32_BYTES * p_mp, g_div)
    optimizer = _ceil_div(ADAMW_STATE_BYTES * p_mp, o_div)
    compute_copy = compute_copy_bytes(model, precision, sharding.strategy, dims)
    if sharding.cpu_offload:
        return MemoryEstimate(weights=0, grads=0, optimizer=0, compute_copy=compute_copy, host=weights + grads + optimizer)
    return MemoryEstimate(weights=weights, grads=grads, optimizer=optimizer, compute_copy=compute_copy, host=0)


def device_memory_bytes(gpu: str) -> int | None:
    """Memory of one accelerator in bytes; None when the GPU model is unknown."""
    spec = GPUS.get(gpu)
    return None if spec is None else int(spec.memory_gib * GIB)


def fit_warning(mem: MemoryEstimate, gpu: str) -> str | None:
    """A one-line warning when the model states alone exceed the GPU's memory; None if they fit or the GPU is unknown."""
    capacity = device_memory_bytes(gpu)
    if capacity is None or mem.total <= capacity:
        return None
    return (
        f"estimated {mem.total / GIB:.1f} GiB per rank for weights, gradients and optimizer states "
        f"(before activations) exceeds the {capacity / GIB:.0f} GiB of one {gpu}; "
        f"shard more (sharding=fsdp, more ranks, tp/pp) or set sharding.cpu_offload=true"
    )
