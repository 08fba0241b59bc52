"""Memory per rank, its verdict, the step time, and the notes that explain both, for one resolved config.

A pure function of the config (`assess`), used by the plan, by its advice (on variants of the
config) and by `plan --compare`.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainctl.config.schema import RunConfig
from trainctl.core import lora, objectives
from trainctl.core.dims import ParallelDims
from trainctl.core.gpus import GPUS, fp8_speedup_bound, peak_flops
from trainctl.core.wrapping import fsdp_shards, replicas, wrapping
from trainctl.plan import fit as fitting
from trainctl.plan import memory
from trainctl.plan import throughput as tp_model
from trainctl.plan.activations import checkpointed_blocks, kv_dim
from trainctl.plan.experts import all_to_all_bytes, moe_layers
from trainctl.plan.flops import flops_per_token
from trainctl.plan.notes import notes_for
from trainctl.plan.stages import rank_stages
from trainctl.plan.transients import DTYPE_BYTES

NOMINAL_PEAK = 1e14  # FLOP/s standing in for an unknown device when only ratios of times are wanted


@dataclass(frozen=True)
class Assessment:
    per_pp_rank: tuple[memory.RankMemory, ...]
    fits: tuple[fitting.Fit, ...]
    busiest: int  # index of the pp rank with the highest need
    step: tp_model.StepTime | None
    relative_step: tp_model.StepTime  # at a nominal peak when the device's is unknown: for comparing variants
    assumed_mfu: float
    peak_flops: float | None
    notes: tuple[str, ...]

    @property
    def memory(self) -> memory.RankMemory:
        return self.per_pp_rank[self.busiest]

    @property
    def fit(self) -> fitting.Fit:
        return self.fits[self.busiest]


def dims_of(cfg: RunConfig) -> ParallelDims:
    """The parallel degrees of a resolved config."""
    return ParallelDims.from_config(cfg.sharding)


def device_peak(cfg: RunConfig) -> float | None:
    if cfg.cluster.device != "cuda":
        return None
    return peak_flops(cfg.cluster.gpu, cfg.precision.compute_dtype)


def assumed_mfu(cfg: RunConfig) -> float:
    return cfg.cluster.assumed_mfu or tp_model.DEFAULT_MFU


def step_time(
    cfg: RunConfig, dims: ParallelDims, mem: memory.RankMemory, n_blocks: int, peak: float | None
) -> tp_model.StepTime | None:
    """Seconds per optimizer step on the busiest rank (throughput module doc); None without a peak."""
    if peak is None:
        return None
    m, t, s, mfu = cfg.model, cfg.train, cfg.sharding, assumed_mfu(cfg)
    c = DTYPE_BYTES[cfg.precision.compute_dtype]
    tokens = t.tokens_per_step
    rate = dims.world_size * peak * mfu * tp_model.micro_batch_efficiency(mem.tokens_per_micro_batch)
    rate *= tp_model.COMPILE_SPEEDUP if t.compile else 1.0
    # tokens_per_step counts both sequences of a preference pair; DPO's reference forward adds a pass over them
    passes = objectives.cost(t.objective, lora.enabled(m.lora)).pass_factor
    compute = flops_per_token(m, t.seq_len) * tokens * passes / rate
    wrapped = checkpointed_blocks(t.activation_checkpointing, m.n_layers, t.ac_every)
    recompute_flops = tp_model.recompute_flops_per_token(m, t.seq_len, t.activation_checkpointing, wrapped)
    recompute = recompute_flops * tokens / (rate * tp_model.RECOMPUTE_SPEEDUP)
    if cfg.precision.fp8:
        factor = tp_model.fp8_time_factor(m, t.seq_len, cfg.precision.fp8_exclude,
                                          fp8_speedup_bound(cfg.cluster.gpu, cfg.precision.compute_dtype),
                                          cfg.precision.fp8_recipe, cfg.precision.fp8_filter)
        compute, recompute = compute * factor, recompute * factor
    if t.activation_checkpointing == "op":
        recompute = tp_model.OP_RECOMPUTE_OVERHEAD * compute
    bubble_fraction = tp_model.bubble_fraction(s.pp_schedule, dims.pp, t.grad_accum, s.pp_stages_per_rank)
    bubble = (compute + recompute) * bubble_fraction
    spec = GPUS.get(cfg.cluster.gpu)
    tp_bytes = tp_model.tp_comm_bytes(m, mem.tokens_per_micro_batch, n_blocks, dims.tp, c) * t.grad_accum
    reduce = DTYPE_BYTES[cfg.precision.reduce_dtype]
    wrap = wrapping(s.strategy, dims, cfg.precision)
    shards = fsdp_shards(wrap, dims)
    fsdp_bytes = tp_model.fsdp_comm_bytes(wrap, mem.local_params, c, reduce, shards, t.grad_accum)
    fsdp_s = fsdp_bytes / bandwidth(cfg, spec, dims.dp_shard * dims.cp * dims.tp)
    ddp_bytes = tp_model.ddp_comm_bytes(wrap, mem.local_params, replicas(wrap, dims))
    ddp_s = ddp_bytes / bandwidth(cfg, spec, dims.dp * dims.cp * dims.tp)
    exposed = max(0.0, fsdp_s + ddp_s - (compute + recompute))
    offload = 0.0
    if s.cpu_offload:
        stored = mem.local_params // shards
        offload = tp_model.offload_seconds(stored, wrap, t.grad_accum, cfg.cluster.procs_per_node)
    tp_s = tp_bytes / bandwidth(cfg, spec, dims.tp)
    cp_bytes = tp_model.cp_comm_bytes(mem.tokens_per_micro_batch, kv_dim(m, dims.cp) // dims.tp, n_blocks, dims.cp, c)
    cp_s = cp_bytes * t.grad_accum / bandwidth(cfg, spec, dims.cp * dims.tp)  # cp sits outside tp in the mesh
    a2a = all_to_all_bytes(m, mem.tokens_per_micro_batch, dims.ep, moe_layers(m, n_blocks), c, t.grad_accum,
                           t.activation_checkpointing == "full")
    ep_s = a2a / bandwidth(cfg, spec, dims.ep * dims.cp * dims.tp)  # ep sits outside cp and tp in the mesh
    return tp_model.StepTime(compute, recompute, bubble, tp_s, exposed, offload, cp_s, ep_s)


def bandwidth(cfg: RunConfig, spec, span: int) -> float:
    """Bytes/s of a group of `span` consecutive ranks: NVLink within a node, the NIC once it spans nodes."""
    if spec is None:
        return 1e12  # unknown device: communication not estimated (there is no step time either)
    crosses = cfg.cluster.nodes > 1 and span > cfg.cluster.procs_per_node
    return (spec.inter_gbs if crosses else spec.intra_gbs) * 1e9


def assess(cfg: RunConfig, dims: ParallelDims) -> Assessment:
    """Per-pp-rank memory and verdict, and the step time, of a resolved config."""
    stages = rank_stages(cfg.model, cfg.sharding, cfg.train.grad_accum)
    per_rank = tuple(memory.estimate(cfg.model, cfg.precision, cfg.sharding, cfg.train, dims, st, cfg.cluster.device,
                                     cfg.optim) for st in stages)  # the config: SGD's state depends on momentum
    capacity = fitting.capacity_bytes(cfg.cluster)
    fits = tuple(fitting.fit(r.peak, cfg.cluster.device, dims, capacity) for r in per_rank)
    busiest = max(range(len(fits)), key=lambda i: fits[i].need_bytes)
    peak = device_peak(cfg)
    n_blocks = len(stages[busiest].layers)
    step = step_time(cfg, dims, per_rank[busiest], n_blocks, peak)
    relative = step or step_time(cfg, dims, per_rank[busiest], n_blocks, NOMINAL_PEAK)
    notes = tuple(notes_for(cfg, dims, per_rank[busiest]))
    return Assessment(per_rank, fits, busiest, step, relative, assumed_mfu(cfg), peak, notes)
