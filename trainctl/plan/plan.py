"""The run plan: what a resolved config will do, computed before anything starts.

Pure functions of the config (no I/O, no torch). `build` expects the config the
validate step resolved: concrete batch sizes and parallel degrees.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from trainctl.config.schema import ClusterConfig, RunConfig, ShardingConfig, TrainConfig
from trainctl.launch.command import launch_argv, shell_join
from trainctl.plan import memory
from trainctl.plan.flops import flops_per_token, param_count
from trainctl.plan.hardware import GPUS, peak_flops
from trainctl.plan.support import unsupported
from trainctl.plan.topology import ParallelDims

# The MFU the rough step time assumes: a typical well-tuned FSDP run on H100s; real runs vary widely.
ASSUMED_MFU = 0.4
# Stands in for the run directory before it exists (its name may get a collision suffix).
RUN_DIR_PLACEHOLDER = "<run_dir>"


class PlanError(Exception):
    """The config given to `build` was not resolved by validate; the message is one line."""


@dataclass(frozen=True)
class BatchMath:
    global_batch: int  # sequences per optimizer step
    micro_batch: int  # sequences per rank per forward
    grad_accum: int  # micro-batches per optimizer step
    dp: int  # data-parallel degree
    seq_len: int
    tokens_per_step: int
    tokens_total: int  # over train.steps


@dataclass(frozen=True)
class RunPlan:
    world_size: int
    nodes: int
    procs_per_node: int
    strategy: str
    dims: ParallelDims
    batch: BatchMath
    params_total: int
    params_per_mp_rank: int  # parameters of one tensor x pipeline shard (even split assumed)
    flops_per_token: float  # model FLOPs, forward + backward
    flops_per_step: float
    memory: memory.MemoryEstimate  # per rank, model states only (no activations)
    device: str  # cpu | cuda
    gpu: str  # key of hardware.GPUS, "" when unknown
    peak_flops_per_device: float | None  # dense peak for the compute dtype; None when unknown
    assumed_mfu: float
    rough_step_time_s: float | None  # at assumed_mfu; rough, for orientation only
    warnings: tuple[str, ...]
    launch_argv: tuple[str, ...]
    launch_command: str

    def to_dict(self) -> dict:
        """Plain JSON-serializable data (written to RUN_DIR/plan.json)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["dims"] = {**self.dims.as_dict(), "dp": self.dims.dp}
        data["batch"] = dataclasses.asdict(self.batch)
        data["memory"] = self.memory.to_dict()
        data["warnings"] = list(self.warnings)
        data["launch_argv"] = list(self.launch_argv)
        return data


def world_size(cluster: ClusterConfig) -> int:
    return cluster.nodes * cluster.procs_per_node


def resolved_dims(sharding: ShardingConfig, world: int) -> ParallelDims:
    """ParallelDims from already-resolved degrees; PlanError if any is unresolved or they don't cover the world."""
    degrees = {
        "dp_replicate": sharding.dp_replicate,
        "dp_shard": sharding.dp_shard,
        "cp": sharding.cp,
        "tp": sharding.tp,
        "pp": sharding.pp,
    }
    unresolved = [f"sharding.{k}={v}" for k, v in degrees.items() if v < 1]
    if unresolved:
        raise PlanError(f"{', '.join(unresolved)}: the plan needs resolved degrees; run the config through validate first")
    dims = ParallelDims(**degrees)
    if dims.world_size != world:
        raise PlanError(f"sharding degrees {dims.as_dict()} multiply to {dims.world_size}, not the world size {world}")
    return dims


def batch_math(train: TrainConfig, dp: int) -> BatchMath:
    """Tokens per step and in total; PlanError if the batch sizes are unresolved."""
    sizes = {"global_batch": train.global_batch, "micro_batch": train.micro_batch, "grad_accum": train.grad_accum}
    unresolved = [f"train.{k}={v}" for k, v in sizes.items() if v < 1]
    if unresolved:
        raise PlanError(f"{', '.join(unresolved)}: the plan needs resolved batch sizes; run the config through validate first")
    tokens_per_step = train.global_batch * train.seq_len
    return BatchMath(
        global_batch=train.global_batch,
        micro_batch=train.micro_batch,
        grad_accum=train.grad_accum,
        dp=dp,
        seq_len=train.seq_len,
        tokens_per_step=tokens_per_step,
        tokens_total=tokens_per_step * train.steps,
    )


def batch_warning(batch: BatchMath) -> str | None:
    expected = batch.micro_batch * batch.grad_accum * batch.dp
    if batch.global_batch == expected:
        return None
    return (
        f"train.global_batch={batch.global_batch} is not micro_batch x grad_accum x dp "
        f"= {batch.micro_batch} x {batch.grad_accum} x {batch.dp} = {expected}"
    )


def gpu_warning(cluster: ClusterConfig) -> str | None:
    if cluster.device != "cuda" or cluster.gpu in GPUS:
        return None
    return f"cluster.gpu={cluster.gpu!r} is not a known GPU ({', '.join(GPUS)}): no memory check and no step-time estimate"


def rough_step_time(flops_per_step: float, world: int, peak: float | None) -> float | None:
    """Seconds per optimizer step if every device ran at ASSUMED_MFU of its peak; None without a peak."""
    if peak is None:
        return None
    return flops_per_step / (world * peak * ASSUMED_MFU)


def device_peak(cfg: RunConfig) -> float | None:
    if cfg.cluster.device != "cuda":
        return None
    return peak_flops(cfg.cluster.gpu, cfg.precision.compute_dtype, cfg.precision.fp8)


def default_run_dir(cfg: RunConfig) -> Path:
    """Where the run would go when its name is already fixed; a placeholder name otherwise."""
    return Path(cfg.runs_dir) / (cfg.name or RUN_DIR_PLACEHOLDER)


def with_run_dir(plan: RunPlan, cluster: ClusterConfig, run_dir: Path) -> RunPlan:
    """The same plan with its launch command pointing at the final run directory."""
    argv = launch_argv(cluster, run_dir)
    return dataclasses.replace(plan, launch_argv=tuple(argv), launch_command=shell_join(argv))


def build(cfg: RunConfig, run_dir: Path | None = None) -> RunPlan:
    """The plan of a resolved config; `run_dir` fixes the path in the launch command (see `with_run_dir`)."""
    world = world_size(cfg.cluster)
    dims = resolved_dims(cfg.sharding, world)
    batch = batch_math(cfg.train, dims.dp)
    per_token = flops_per_token(cfg.model, cfg.train.seq_len)
    per_step = per_token * batch.tokens_per_step
    mem = memory.estimate(cfg.model, cfg.precision, cfg.sharding, dims)
    peak = device_peak(cfg)
    warnings = [batch_warning(batch), gpu_warning(cfg.cluster), *unsupported(cfg.sharding, cfg.precision)]
    if cfg.cluster.device == "cuda":
        warnings.append(memory.fit_warning(mem, cfg.cluster.gpu))
    argv = launch_argv(cfg.cluster, run_dir or default_run_dir(cfg))
    return RunPlan(
        world_size=world,
        nodes=cfg.cluster.nodes,
        procs_per_node=cfg.cluster.procs_per_node,
        strategy=cfg.sharding.strategy,
        dims=dims,
        batch=batch,
        params_total=param_count(cfg.model),
        params_per_mp_rank=memory.model_parallel_params(cfg.model, dims),
        flops_per_token=per_token,
        flops_per_step=per_step,
        memory=mem,
        device=cfg.cluster.device,
        gpu=cfg.cluster.gpu,
        peak_flops_per_device=peak,
        assumed_mfu=ASSUMED_MFU,
        rough_step_time_s=rough_step_time(per_step, world, peak),
        warnings=tuple(w for w in warnings if w),
        launch_argv=tuple(argv),
        launch_command=shell_join(argv),
    )
