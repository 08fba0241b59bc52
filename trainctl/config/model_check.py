"""Model shape checks of a composed RunConfig: heads, sequence length, the family's own, and the parallel degrees."""

from __future__ import annotations

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
    problems += registry.spec(m.family).problems(m, t.seq_len)
    if m.n_heads % m.n_kv_heads:
        problems.append(f"model.n_kv_heads={m.n_kv_heads}: must divide model.n_heads={m.n_heads} (grouped-query "
                        f"attention); use a divisor such as {_divisors(m.n_heads)}")
    if t.seq_len > m.max_seq_len:
        problems.append(f"train.seq_len={t.seq_len}: longer than model.max_seq_len={m.max_seq_len} of model {m.name}; "
                        f"use at most {m.max_seq_len}")
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
    if dims.pp > m.n_layers:
        problems.append(f"sharding.pp={dims.pp}: more pipeline stages than model.n_layers={m.n_layers}")
    return problems
