"""Variants of a resolved config along one axis, each re-resolved by validate (so each is a config `launch` accepts).

Used by the advice (what would make it fit) and by `plan --compare AXIS`. The global batch
stays fixed: when a variant changes the data-parallel degree or the micro-batch, the number of
accumulation steps is derived again (a variant whose batch does not divide is left out).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trainctl.config.errors import ConfigError
from trainctl.config.schema import AC_MODES, OptimConfig, RunConfig
from trainctl.config.validate import resolve
from trainctl.core import optimizers
from trainctl.core.support import unsupported
from trainctl.core.wrapping import REPLICATING

AXES = ("sharding", "checkpointing", "tp", "micro_batch", "optim", "ep")
ZERO_ORDER = ("ddp", "zero1", "zero2", "zero3")


@dataclass(frozen=True)
class Variant:
    label: str  # what changes, short: zero3, ac=full, tp=2, micro_batch=4
    overrides: tuple[str, ...]  # the key=value overrides a user would add
    cfg: RunConfig  # resolved


def _replace(cfg: RunConfig, **groups) -> RunConfig:
    return dataclasses.replace(cfg, **{g: dataclasses.replace(getattr(cfg, g), **kv) for g, kv in groups.items()})


def _resolved(label: str, overrides: list[str], cfg: RunConfig) -> Variant | None:
    """The variant if validate accepts it and the worker implements it; None otherwise."""
    try:
        cfg = resolve(cfg)
    except ConfigError:
        return None
    if unsupported(cfg.sharding, cfg.precision):
        return None
    return Variant(label, tuple(overrides), cfg)


def _rebatched(cfg: RunConfig, **train) -> dict:
    """Train keys that keep the global batch and derive the accumulation again."""
    return {"train": {**train, "grad_accum": -1, "global_batch": cfg.train.global_batch}}


def with_strategy(cfg: RunConfig, strategy: str, cpu_offload: bool = False) -> Variant | None:
    """The same ranks under another ZeRO stage (all data-parallel ranks replicate or shard)."""
    s = cfg.sharding
    dp = s.dp_replicate * s.dp_shard
    replicate = strategy in REPLICATING
    degrees = {"dp_replicate": dp if replicate else 1, "dp_shard": 1 if replicate else dp}
    if strategy == "none" and dp > 1:
        return None
    sharding = {"strategy": strategy, "cpu_offload": cpu_offload, **degrees}
    overrides = [f"sharding={strategy}"] + (["sharding.cpu_offload=true"] if cpu_offload else [])
    label = strategy + ("+offload" if cpu_offload else "")
    return _resolved(label, overrides, _replace(cfg, sharding=sharding))


def with_checkpointing(cfg: RunConfig, mode: str) -> Variant | None:
    key = f"train.activation_checkpointing={mode}"
    return _resolved(f"ac={mode}", [key], _replace(cfg, train={"activation_checkpointing": mode}))


def with_tp(cfg: RunConfig, tp: int) -> Variant | None:
    """tp ranks taken from (or given back to) data parallelism; tp stays within a node."""
    s = cfg.sharding
    if tp > cfg.cluster.procs_per_node or tp < 1:
        return None
    ranks = s.dp_replicate * s.dp_shard * s.tp
    if ranks % tp:
        return None
    dp = ranks // tp
    replicate = s.strategy in REPLICATING or (s.strategy == "none" and dp > 1)
    strategy = "ddp" if s.strategy == "none" and dp > 1 else s.strategy
    if s.strategy == "hsdp":
        divides = dp % s.dp_replicate == 0
        degrees = {"dp_replicate": s.dp_replicate, "dp_shard": dp // s.dp_replicate} if divides else None
    else:
        degrees = {"dp_replicate": dp if replicate else 1, "dp_shard": 1 if replicate else dp}
    if degrees is None:
        return None
    variant = _replace(cfg, sharding={"tp": tp, "strategy": strategy, **degrees}, **_rebatched(cfg))
    overrides = [f"sharding.tp={tp}"] + ([f"sharding={strategy}"] if strategy != s.strategy else [])
    return _resolved(f"tp={tp}", overrides, variant)


def with_micro_batch(cfg: RunConfig, micro_batch: int) -> Variant | None:
    key = f"train.micro_batch={micro_batch}"
    variant = _replace(cfg, **_rebatched(cfg, micro_batch=micro_batch))
    return _resolved(f"micro_batch={micro_batch}", [key, "train.grad_accum=-1"], variant)


def with_optimizer(cfg: RunConfig, name: str) -> Variant | None:
    """Another optimizer with its keys at the schema's defaults: its state bytes depend on none of them but SGD's
    momentum (0.9 there, as conf/optim/sgd.yaml). Left out where the layout cannot hold it (Muon under zero1)."""
    optim = OptimConfig(name=name, grad_clip=cfg.optim.grad_clip)
    return _resolved(name, [f"optim={name}"], dataclasses.replace(cfg, optim=optim))


def with_ep(cfg: RunConfig, ep: int) -> Variant | None:
    """The routed experts split over `ep` of the dp_shard ranks (validate leaves out what cannot split)."""
    return _resolved(f"ep={ep}", [f"sharding.ep={ep}"], _replace(cfg, sharding={"ep": ep}))


def _divisors_up_to(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def along(cfg: RunConfig, axis: str) -> list[Variant]:
    """Every variant of `cfg` along one axis of AXES, the config itself included (first)."""
    current = Variant("(as configured)", (), cfg)
    if axis == "sharding":
        # The config is resolved: an alias (fsdp) is already the strategy it names.
        found = [with_strategy(cfg, name) for name in ("none", *ZERO_ORDER) if name != cfg.sharding.strategy]
        found.append(with_strategy(cfg, "zero3", cpu_offload=True) if not cfg.sharding.cpu_offload else None)
    elif axis == "checkpointing":
        found = [with_checkpointing(cfg, mode) for mode in AC_MODES if mode != cfg.train.activation_checkpointing]
    elif axis == "tp":
        found = [with_tp(cfg, tp) for tp in (1, 2, 4, 8) if tp != cfg.sharding.tp]
    elif axis == "micro_batch":
        per_rank = cfg.train.micro_batch * cfg.train.grad_accum
        found = [with_micro_batch(cfg, mb) for mb in _divisors_up_to(per_rank, 64) if mb != cfg.train.micro_batch]
    elif axis == "optim":
        found = [with_optimizer(cfg, name) for name in optimizers.names() if name != cfg.optim.name]
    elif axis == "ep":  # the divisors of dp_shard; validate refuses dense models and experts that do not split
        found = [with_ep(cfg, ep) for ep in _divisors_up_to(cfg.sharding.dp_shard, 64) if ep != cfg.sharding.ep]
    else:
        raise ValueError(f"unknown axis {axis!r}")
    return [current] + [v for v in found if v is not None]
