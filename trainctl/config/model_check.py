"""Model shape checks of a composed RunConfig: heads, sequence length, the family's own, and the parallel degrees."""

from __future__ import annotations

from dataclasses import fields

from trainctl.config import schema
from trainctl.config.fields import declared_problems
from trainctl.core.dims import ParallelDims
from trainctl.models import registry

MAX_LAYERS = 10_000  # the plan works layer by layer: an absurd count would hang it rather than fail


def check_model(m: schema.ModelConfig, t: schema.TrainConfig) -> list[str]:
    """Shapes that must agree: heads vs kv-heads vs dim, sequence vs model limit, and the family's own checks."""
    if declared_problems(m, "model"):
        return []  # an unknown family or a shape out of its declared range: declared_problems names them
    if m.n_layers > MAX_LAYERS:
        return [f"model.n_layers={m.n_layers}: more than {MAX_LAYERS} layers; "
                "the largest published models have under 200"]
    problems = []
    problems += registry.spec(m.family).problems(m, t.seq_len) + dense_moe_problems(m)
    if m.n_heads % m.n_kv_heads:
        problems.append(f"model.n_kv_heads={m.n_kv_heads}: must divide model.n_heads={m.n_heads} (grouped-query "
                        f"attention); use a divisor such as {_divisors(m.n_heads)}")
    if t.seq_len > m.max_seq_len:
        problems.append(f"train.seq_len={t.seq_len}: longer than model.max_seq_len={m.max_seq_len} of model {m.name}; "
                        f"use at most {m.max_seq_len}")
    return problems


def _is_moe(family: str) -> bool:
    return getattr(registry.spec(family), "is_moe", False)  # models/common/moe_shape.py's MoEShape


def dense_moe_problems(m: schema.ModelConfig) -> list[str]:
    """model.moe keys on a dense family would be ignored without a word: refused, naming the MoE families."""
    if _is_moe(m.family) or m.moe == schema.MoEConfig():
        return []
    changed = next(f.name for f in fields(m.moe) if getattr(m.moe, f.name) != getattr(schema.MoEConfig(), f.name))
    moe_families = " or ".join(f for f in registry.names() if _is_moe(f))
    return [f"model.moe.{changed}={getattr(m.moe, changed)}: model.family={m.family} is dense (no experts); use "
            f"model.family={moe_families} (e.g. model=qwen3_moe_tiny), or leave model.moe unset"]


def moe_parallel_problems(dims: ParallelDims, m: schema.ModelConfig) -> list[str]:
    """What the mixture-of-experts families do not run: under tensor parallelism (experts replicated over tp, each rank
    routing its own sequence shard) a capacity, which would count each rank's shard instead of the micro-batch.
    Pipeline stages run them: each stage backpropagates its own layers' auxiliary loss (train/parallel/stage_aux.py);
    expert parallelism refuses pp itself (layout_check.check_expert_parallel)."""
    if not _is_moe(m.family):
        return []
    problems = []
    if dims.tp > 1 and m.moe.capacity_factor:
        problems.append(f"model.moe.capacity_factor={m.moe.capacity_factor}: with sharding.tp={dims.tp} each tp rank "
                        "routes its own part of the sequence, so a capacity would drop other tokens than one process; "
                        "use capacity_factor=0 (no drop) or tp=1")
    return problems


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def check_model_parallel(dims: ParallelDims, m: schema.ModelConfig) -> list[str]:
    problems = []
    if m.family not in registry.names():
        return []  # check_model names it
    if dims.tp > 1:
        for key, value in registry.spec(m.family).tp_divides(m).items():
            if value % dims.tp:
                problems.append(f"sharding.tp={dims.tp}: does not divide model.{key}={value}; use a tp degree that "
                                f"divides it ({_divisors(value)})")
    problems += moe_parallel_problems(dims, m)
    if dims.pp > m.n_layers:
        problems.append(f"sharding.pp={dims.pp}: more pipeline stages than model.n_layers={m.n_layers}")
    return problems
