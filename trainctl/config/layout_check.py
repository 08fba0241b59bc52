"""Parallel layout checks of a composed RunConfig: degrees a strategy allows, offload, pipeline, context parallel."""

from __future__ import annotations

from trainctl.config import schema
from trainctl.core.dims import ParallelDims, degree_problems, degrees_of, infer_degrees
from trainctl.core.wrapping import REPLICATING, SHARDING_WITHIN_GROUP, canonical, shards_parameters


def _strategy_constraints(sh: schema.ShardingConfig) -> list[str]:
    """Problems with the degrees a strategy allows, before any inference."""
    problems, strategy = [], canonical(sh.strategy)
    if strategy == "none":
        if (sh.dp_replicate, sh.dp_shard) != (1, 1):
            problems.append("sharding.strategy=none needs dp_replicate=1 and dp_shard=1; "
                            "choose sharding=ddp or sharding=fsdp for data parallelism")
    elif strategy in REPLICATING and sh.dp_shard != 1:
        problems.append(f"sharding.dp_shard={sh.dp_shard}: strategy {sh.strategy} replicates parameters, "
                        "so dp_shard must be 1 (use sharding=hsdp to combine both)")
    elif strategy in SHARDING_WITHIN_GROUP and sh.dp_replicate != 1:
        problems.append(f"sharding.dp_replicate={sh.dp_replicate}: strategy {sh.strategy} shards within one group, "
                        "so dp_replicate must be 1 (use sharding=hsdp to combine both)")
    return problems


def infer_dims(sh: schema.ShardingConfig, world_size: int) -> tuple[ParallelDims | None, list[str]]:
    """Resolve -1 degrees against `world_size`; returns (dims, problems)."""
    problems = _strategy_constraints(sh) + degree_problems(degrees_of(sh))
    if problems:
        return None, problems
    return infer_degrees(degrees_of(sh), world_size)


def check_offload(sh: schema.ShardingConfig) -> list[str]:
    if sh.cpu_offload and not shards_parameters(sh.strategy):
        return ["sharding.cpu_offload=true: offload is an FSDP2 policy; use sharding=zero3 (or zero2/hsdp), not "
                f"{sh.strategy}"]
    return []


def check_pipeline(
    sh: schema.ShardingConfig, dims: ParallelDims, m: schema.ModelConfig, t: schema.TrainConfig
) -> list[str]:
    """Stages, layer split, schedule and chunking of a pipeline-parallel run."""
    if dims.pp == 1:
        return _pp_layers_problems(sh, 1, m)  # one stage: the plan and the worker still split by pp_layers
    problems = []
    if m.tie_embeddings:
        problems.append("model.tie_embeddings=true: the first and last pipeline stages would share the embedding; use "
                        "sharding.pp=1 or an untied model")
    if t.compile and sh.pp_schedule == "interleaved_zero_bubble":
        # Its split input/weight backward rejects compiled modules (torch 2.11-2.13).
        problems.append("train.compile=true: sharding.pp_schedule=interleaved_zero_bubble cannot run compiled blocks; "
                        "set train.compile=false or use interleaved_1f1b")
    stages = dims.pp * sh.pp_stages_per_rank
    interleaved = sh.pp_schedule.startswith("interleaved")
    if interleaved and sh.pp_stages_per_rank < 2:
        problems.append(f"sharding.pp_stages_per_rank={sh.pp_stages_per_rank}: schedule {sh.pp_schedule} runs several "
                        "stages per rank; set it to 2 or more")
    if not interleaved and sh.pp_stages_per_rank != 1:
        problems.append(f"sharding.pp_stages_per_rank={sh.pp_stages_per_rank}: schedule {sh.pp_schedule} runs one "
                        "stage per rank; set it to 1 or use an interleaved schedule")
    problems += _pp_layers_problems(sh, stages, m)
    if not sh.pp_layers and stages > m.n_layers:
        problems.append(f"sharding.pp={dims.pp} x pp_stages_per_rank={sh.pp_stages_per_rank}: {stages} stages for "
                        f"model.n_layers={m.n_layers}; use fewer stages")
    # Each of the step's grad_accum micro-batches is one pipeline microbatch.
    if sh.pp_schedule != "gpipe" and t.grad_accum < dims.pp:
        problems.append(f"train.grad_accum={t.grad_accum}: schedule {sh.pp_schedule} needs at least "
                        f"sharding.pp={dims.pp} pipeline microbatches per step; raise train.global_batch or lower "
                        "train.micro_batch")
    if interleaved and t.grad_accum % dims.pp:
        problems.append(f"train.grad_accum={t.grad_accum}: interleaved schedules need a multiple of "
                        f"sharding.pp={dims.pp} microbatches per step")
    return problems


def _pp_layers_problems(sh: schema.ShardingConfig, stages: int, m: schema.ModelConfig) -> list[str]:
    if sh.pp_layers and (len(sh.pp_layers) != stages or sum(sh.pp_layers) != m.n_layers or min(sh.pp_layers) < 1):
        return [f"sharding.pp_layers={list(sh.pp_layers)}: needs {stages} positive entries (pp x pp_stages_per_rank) "
                f"summing to model.n_layers={m.n_layers}, or [] for an even split"]
    return []


def check_context_parallel(dims: ParallelDims, c: schema.ClusterConfig, t: schema.TrainConfig) -> list[str]:
    if dims.cp == 1:
        return []
    if c.device != "cuda":
        return [f"sharding.cp={dims.cp}: context parallelism needs CUDA attention kernels (torch's context_parallel); "
                f"use sharding.cp=1 on cluster.device={c.device}"]
    if t.seq_len % (2 * dims.cp):
        return [f"sharding.cp={dims.cp}: train.seq_len={t.seq_len} must be a multiple of 2 x cp = {2 * dims.cp} "
                "(load-balanced sequence shards)"]
    return []


# Strategies expert parallelism runs under: FSDP2 shards the experts over the data-parallel ranks left (efsdp).
EP_STRATEGIES = ("zero2", "zero3", "hsdp")


def check_expert_parallel(sh: schema.ShardingConfig, dims: ParallelDims, m: schema.ModelConfig,
                          t: schema.TrainConfig) -> list[str]:
    """Expert parallelism (sharding.ep): an MoE model whose experts and dp_shard split evenly; what it runs with."""
    ep, experts = sh.ep, m.moe.num_experts
    if ep < 1:
        return [f"sharding.ep={ep}: must be a positive integer (1: no expert parallelism)"]
    if ep == 1:
        return []
    if experts == 0:
        return [f"sharding.ep={ep}: model.moe.num_experts=0 is a dense model with no experts to split; "
                "use sharding.ep=1 or a mixture-of-experts model"]
    problems = []
    if experts % ep:
        divisors = [d for d in range(1, experts + 1) if experts % d == 0]
        problems.append(f"sharding.ep={ep}: model.moe.num_experts={experts} does not split evenly over {ep} ranks; "
                        f"use an ep that divides it ({', '.join(map(str, divisors))})")
    if canonical(sh.strategy) not in EP_STRATEGIES:
        problems.append(f"sharding.ep={ep}: expert parallelism runs under sharding=zero2, zero3 (fsdp) or hsdp, "
                        f"not strategy {sh.strategy}")
    elif dims.dp_shard % ep:
        problems.append(f"sharding.ep={ep}: the ep ranks are carved from sharding.dp_shard={dims.dp_shard} "
                        f"(data-parallel size {dims.dp}); use an ep that divides dp_shard, or raise dp_shard")
    if dims.pp > 1 and sh.pp_schedule == "interleaved_zero_bubble":
        # its backward split into input and weight parts may run ep peers' all-to-alls in different orders
        problems.append(f"sharding.ep={ep}: sharding.pp_schedule=interleaved_zero_bubble is not implemented with "
                        "expert parallelism; use pp_schedule=gpipe, 1f1b or interleaved_1f1b")
    if dims.pp > 1 and dims.tp > 1:
        problems.append(f"sharding.ep={ep}: expert parallelism with both sharding.tp={dims.tp} and "
                        f"sharding.pp={dims.pp} is not implemented; use ep with tp or ep with pp")
    unsupported = [(dims.cp > 1, f"sharding.cp={dims.cp}"),
                   (sh.cpu_offload, "sharding.cpu_offload=true"), (t.compile, "train.compile=true")]
    problems += [f"sharding.ep={ep}: expert parallelism with {key} is not implemented; use it with data "
                 "parallelism (zero2, zero3, hsdp) and activation checkpointing, or sharding.ep=1"
                 for wanted, key in unsupported if wanted]
    return problems
