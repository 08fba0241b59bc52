"""A resume on another world size or parallel split: the keys re-derived, and the layouts DCP cannot reshard refused.

config.yaml holds the resolved config: the data-parallel degree and the grad accumulation of the world it was
launched on. When a resume changes the world (cluster.nodes, cluster.procs_per_node) or the split (sharding.*),
those derived values are opened again: the data-parallel degree takes the rest of the new world, and the step's
micro-batches are recomputed so that the global batch stays (the data stream is indexed by global sample, see
train/loop/data.py, so the continuation reads the samples the interrupted run would have read). Keys the user sets
in the resume's overrides are kept as given.

The model and the optimizer go through DCP, which reshards them to any layout (train/checkpoint/state.py), except
zero1's optimizer state: ZeroRedundancyOptimizer's shards are saved per rank and load only into the same layout.
"""

from __future__ import annotations

import dataclasses

from trainctl.config.errors import ConfigError
from trainctl.config.layout_check import infer_dims
from trainctl.config.schema import RunConfig
from trainctl.config.validate import world_size
from trainctl.core.wrapping import REPLICATING, SHARDING_WITHIN_GROUP, canonical

WORLD_KEYS = ("cluster.nodes", "cluster.procs_per_node")
DEGREES = ("dp_replicate", "dp_shard", "tp", "pp", "cp")
PER_RANK = "zero1"  # the strategy whose optimizer state DCP does not hold (saved per rank)


def layout_changed(old: RunConfig, new: RunConfig) -> bool:
    """Whether the world size or any sharding key differs (what makes a resume a resharding one)."""
    return world_size(old.cluster) != world_size(new.cluster) or old.sharding != new.sharding


def relayout(old: RunConfig, new: RunConfig, keys: set[str]) -> RunConfig:
    """`new` (old with the overrides `keys` set) with its data-parallel degree and batch split derived anew.

    Unchanged when the layout is; raises ConfigError (one line) for a layout the checkpoint cannot load into
    or a world that cannot split the global batch.
    """
    if not layout_changed(old, new):
        return new
    refuse_per_rank_state(old, new)
    new = dataclasses.replace(new, sharding=_open_dp(new.sharding, keys))
    world = world_size(new.cluster)
    if world < 1:  # resolve reports the world size in its own words, with every other problem
        return new
    dims, problems = infer_dims(new.sharding, world)
    if problems or dims.dp < 1:  # likewise
        return new
    return dataclasses.replace(new, train=_split_batch(new, dims.dp, keys, _accum_fits(new.sharding, dims.pp)))


def _open_dp(sharding, keys: set[str]):
    """The strategy's data-parallel degree back to -1 (inferred from the world), unless the user set it."""
    strategy = canonical(sharding.strategy)
    if strategy in REPLICATING or strategy == "hsdp":  # hsdp keeps its shard group and replicates across groups
        derived, fixed = "dp_replicate", {"dp_shard": 1} if strategy != "hsdp" else {}
    elif strategy in SHARDING_WITHIN_GROUP:
        derived, fixed = "dp_shard", {"dp_replicate": 1}
    else:  # none: no data parallelism
        derived, fixed = None, {"dp_replicate": 1, "dp_shard": 1}
    values = {k: v for k, v in fixed.items() if f"sharding.{k}" not in keys}
    if derived and f"sharding.{derived}" not in keys:
        values[derived] = -1
    return dataclasses.replace(sharding, **values)


def _accum_fits(sharding, pp: int):
    """Which grad_accum the pipeline schedule takes: one microbatch per accumulation step (see layout_check.py)."""
    if pp == 1 or sharding.pp_schedule == "gpipe":
        return lambda accum: True
    if sharding.pp_schedule.startswith("interleaved"):
        return lambda accum: accum % pp == 0
    return lambda accum: accum >= pp


def _split_batch(cfg: RunConfig, dp: int, keys: set[str], fits=lambda accum: True):
    """The same global batch over `dp` ranks: the largest micro-batch up to the run's that divides a rank's share
    (into as many accumulation steps as the pipeline needs, `fits`), and as many accumulation steps as that takes.
    A micro_batch or grad_accum given in the overrides is kept."""
    train = cfg.train
    given = keys & {"train.micro_batch", "train.grad_accum"}
    if given:  # the one given is kept and the other derived, unless both are
        other = {"train.micro_batch", "train.grad_accum"} - given
        return dataclasses.replace(train, **{k.split(".")[1]: -1 for k in other})
    global_batch = train.global_batch
    if global_batch % dp:
        world = " ".join(f"{k}={_value(cfg, k)}" for k in WORLD_KEYS)
        raise ConfigError([f"{world}: a data-parallel degree of {dp} cannot split train.global_batch={global_batch}, "
                           f"which a resume keeps; use a world whose data-parallel degree divides {global_batch}"])
    share = global_batch // dp
    divisors = [m for m in range(1, min(train.micro_batch, share) + 1) if share % m == 0]
    micro = max([m for m in divisors if fits(share // m)] or divisors)  # none fits: resolve names the pipeline's need
    return dataclasses.replace(train, micro_batch=micro, grad_accum=share // micro)


def refuse_per_rank_state(old: RunConfig, new: RunConfig) -> None:
    """zero1 in or out, or zero1 on another layout: its optimizer shards are per rank; one line saying so."""
    strategies = (canonical(old.sharding.strategy), canonical(new.sharding.strategy))
    if PER_RANK not in strategies:
        return
    before = f"{world_size(old.cluster)} workers, {old.sharding.strategy}"
    raise ConfigError([f"sharding.strategy={new.sharding.strategy} on {world_size(new.cluster)} workers: the run's "
                       f"zero1 optimizer state is saved per rank and cannot be resharded (DCP holds only the model); "
                       f"resume on its layout ({before}), or launch a new run from its weights with "
                       "checkpoint.resume=RUN_DIR checkpoint.load_only=model"])


def note(old: RunConfig, new: RunConfig) -> str | None:
    """What the resume tells when it reshards; None when the layout stays."""
    if not layout_changed(old, new):
        return None
    t = new.train
    return (f"resharding from {world_size(old.cluster)} to {world_size(new.cluster)} workers "
            f"({_split(old)} -> {_split(new)}): the model and optimizer are resharded from the checkpoint, the data "
            f"continues at the same global sample; global batch {t.global_batch} = {t.micro_batch} micro x "
            f"{t.grad_accum} accum x {new.sharding.dp_replicate * new.sharding.dp_shard} dp")


def _split(cfg: RunConfig) -> str:
    s = cfg.sharding
    degrees = " ".join(f"{k}={getattr(s, k)}" for k in DEGREES if getattr(s, k) != 1)
    return f"{s.strategy}{' ' + degrees if degrees else ''}"


def _value(cfg: RunConfig, key: str):
    group, name = key.split(".")
    return getattr(getattr(cfg, group), name)
