"""More GPUs for a rank that does not fit: the same run spread over more ranks, each GPU count planned.

Three ways to spread, each tried at doubling counts until one fits (`fits` plans it: memory is not
guessed from a formula): on Slurm `cluster.nodes` x 2, x 4, ... (up to x MAX_NODE_FACTOR), on a
local machine `cluster.procs_per_node` 2, 4, 8 GPUs.
    more data parallel   the same strategy over more ranks (ZeRO-1/2/3 shard more; DDP's would not help)
    ZeRO-3               parameters, gradients and optimizer states sharded over every rank
    more pipeline        pipeline stages x k, the data-parallel degree kept
The global batch stays as configured: the accumulation (or the micro-batch) is derived again. Each
variant is validated like a launch, and its overrides are exactly the keys that change, with their
resolved values (`cluster.nodes=4 sharding.dp_shard=32 train.grad_accum=2`), so adding them to the
command line gives that config whatever the recipe left to be derived.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from trainctl.config.errors import ConfigError
from trainctl.config.schema import RunConfig
from trainctl.config.validate import resolve
from trainctl.core.support import unsupported
from trainctl.core.wrapping import REPLICATING, SHARDING_WITHIN_GROUP
from trainctl.plan.variants import Variant

MAX_NODE_FACTOR = 64
LOCAL_GPUS = (2, 4, 8)  # GPUs of one machine: 8 is the largest common node
_CHANGING = ("cluster", "sharding", "train")


def scaled_variants(cfg: RunConfig, fits: Callable[[RunConfig], bool]) -> list[Variant]:
    """For each way to spread (module doc), the variant at the fewest GPUs that `fits`; none where none does."""
    if cfg.cluster.device != "cuda":
        return []  # CPU workers of one machine share its memory: more of them hold no more
    found = []
    for spread in (_more_data_parallel, _zero3, _more_pipeline):
        for factor, cluster in _counts(cfg):
            variant = spread(cfg, factor, cluster)
            if variant is not None and fits(variant.cfg):
                found.append(variant)
                break
    return found


def _counts(cfg: RunConfig) -> Iterator[tuple[int, dict]]:
    """(factor of the world size, the cluster keys that give it), smallest first."""
    c = cfg.cluster
    if c.multi_node:
        factor = 2
        while factor <= MAX_NODE_FACTOR:
            yield factor, {"nodes": c.nodes * factor}
            factor *= 2
    elif c.on_this_machine:
        for gpus in LOCAL_GPUS:
            if gpus > c.procs_per_node and gpus % c.procs_per_node == 0:
                yield gpus // c.procs_per_node, {"procs_per_node": gpus}


def _more_data_parallel(cfg: RunConfig, factor: int, cluster: dict) -> Variant | None:
    s = cfg.sharding
    if s.strategy in SHARDING_WITHIN_GROUP:
        degrees = {"dp_shard": s.dp_shard * factor}
    elif s.strategy in REPLICATING and s.strategy != "ddp":  # ZeRO-1 shards the optimizer states over dp
        degrees = {"dp_replicate": s.dp_replicate * factor}
    else:
        return None  # DDP and HSDP's replicas hold as much per rank; ZeRO-3 below spreads those
    return _variant(cfg, cluster, degrees)


def _zero3(cfg: RunConfig, factor: int, cluster: dict) -> Variant | None:
    s = cfg.sharding
    if s.strategy == "zero3":
        return None  # the same as more data parallel
    dp = s.dp_replicate * s.dp_shard * factor
    return _variant(cfg, cluster, {"strategy": "zero3", "dp_replicate": 1, "dp_shard": dp, "cpu_offload": False})


def _more_pipeline(cfg: RunConfig, factor: int, cluster: dict) -> Variant | None:
    if cfg.sharding.pp_layers:
        return None  # a hand-made split of the layers into stages: not ours to redo
    return _variant(cfg, cluster, {"pp": cfg.sharding.pp * factor})


def _variant(cfg: RunConfig, cluster: dict, sharding: dict) -> Variant | None:
    """The first way of keeping the global batch that validates; None if none does."""
    t = cfg.train
    pp = sharding.get("pp", cfg.sharding.pp)
    for train in ({"grad_accum": -1}, {"micro_batch": -1, "grad_accum": 1}, {"micro_batch": -1, "grad_accum": pp}):
        candidate = _replace(cfg, cluster=cluster, sharding=sharding,
                             train={"global_batch": t.global_batch, "micro_batch": t.micro_batch, **train})
        try:
            resolved = resolve(candidate)
        except ConfigError:
            continue
        if unsupported(resolved.sharding, resolved.precision):
            continue
        overrides = changed_keys(cfg, resolved)
        world = resolved.cluster.nodes * resolved.cluster.procs_per_node
        where = f"{resolved.cluster.nodes} nodes" if cfg.cluster.multi_node else "one machine"
        return Variant(f"{world} GPUs ({where})", tuple(overrides), resolved)
    return None


def changed_keys(old: RunConfig, new: RunConfig) -> list[str]:
    """`group.key=value` for every key of the changing groups whose resolved value differs."""
    out = []
    for group in _CHANGING:
        before, after = dataclasses.asdict(getattr(old, group)), dataclasses.asdict(getattr(new, group))
        out += [f"{group}.{key}={_text(value)}" for key, value in after.items() if before[key] != value]
    return out


def _text(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _replace(cfg: RunConfig, **groups) -> RunConfig:
    return dataclasses.replace(cfg, **{g: dataclasses.replace(getattr(cfg, g), **kv) for g, kv in groups.items()})
