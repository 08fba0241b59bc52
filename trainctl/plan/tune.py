"""`trainctl tune`'s planning half: the layouts a config's cluster could run, those that fit, ranked by speed.

Candidates are the config itself and its variants (variants.py) along sharding strategy x tensor parallel x context
parallel x expert parallel x pipeline x activation checkpointing x micro-batch, combined in that order over the same
ranks and the same global batch; each candidate is a config `launch` accepts and the overrides that give it from the
user's recipe. Context parallelism (cp: the divisors of the data-parallel ranks up to MAX_CP, taken from data
parallelism) is a speed layout like tp: it splits each sequence across cp ranks and runs exact (ring) attention, so
the loss is the same; validate decides where it is legal (CUDA attention kernels, seq_len a multiple of 2 x cp, not
with pipelines or zero1). A mixture-of-experts model also tries expert parallelism (ep: the divisors of dp_shard
that split its experts; plan/experts.py prices the all-to-all). Pipeline stages (pp 2 and 4, taken from data
parallelism, the layers split evenly) are tried after them where the world and the layers allow. The set is bounded
(MAX_CANDIDATES) and deduplicated by what the worker runs (strategy, degrees, checkpointing, micro-batch).

Ranking: those that launch accepts (fits, tight, or an unknown capacity) by predicted tokens/s, highest first. The
prediction is the throughput model's step time (throughput.py) at the device's peak; a device without a known peak
(a CPU) is ranked by the same model at a nominal peak, whose absolute tokens/s mean nothing
(`predicted_tokens_per_s` is None then) but whose ratios between candidates are the model's.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from trainctl.config.errors import ConfigError
from trainctl.config.schema import AC_MODES, RunConfig
from trainctl.config.validate import resolve
from trainctl.core.support import unsupported
from trainctl.core.wrapping import REPLICATING
from trainctl.plan import variants
from trainctl.plan.assess import assess, dims_of
from trainctl.plan.more_gpus import changed_keys
from trainctl.plan.variants import Variant

MAX_CANDIDATES = 2048  # every layout of an 8-GPU node (about 1250 with cp), a few ms of planning each
MAX_CP = 16  # ring attention's exchanges grow with cp: beyond this the sequence is better split another way
FITTING = ("fits", "tight", "unknown")  # what launch accepts (unknown: no capacity known, e.g. CPU nodes)


@dataclass(frozen=True)
class Candidate:
    label: str  # the changes from the config, e.g. "zero3, tp=2, ac=full"; "(as configured)" for none
    overrides: tuple[str, ...]  # key=value overrides added to the recipe's to get this layout
    cfg: RunConfig
    peak_bytes: int  # the busiest rank's predicted allocator peak
    need_bytes: int
    verdict: str
    predicted_tokens_per_s: float | None  # None without the device's peak
    relative_speed: float  # tokens/s under the model at a nominal peak, for ranking when the peak is unknown

    def to_dict(self) -> dict:
        return {"label": self.label, "overrides": list(self.overrides), "peak_bytes": self.peak_bytes,
                "need_bytes": self.need_bytes, "verdict": self.verdict,
                "predicted_tokens_per_s": self.predicted_tokens_per_s, "relative_speed": self.relative_speed}


def _chain(base: Variant, step: Variant) -> Variant:
    """`step` (a variant of `base.cfg`) with `base`'s changes before it."""
    if not step.overrides:
        return base
    if not base.overrides:
        return step
    # A key `step` sets again (train.grad_accum after pp's) is said once, with the later value.
    again = {o.split("=", 1)[0] for o in step.overrides}
    kept = tuple(o for o in base.overrides if o.split("=", 1)[0] not in again)
    return Variant(f"{base.label}, {step.label}", kept + step.overrides, step.cfg)


def _expand(found: list[Variant], make) -> list[Variant]:
    """Each variant followed by its variants from `make(cfg)` (which includes the cfg itself first)."""
    return [_chain(v, step) for v in found for step in make(v.cfg)]


def _strategies(cfg: RunConfig) -> list[Variant]:
    names = [n for n in ("none", *variants.ZERO_ORDER) if n != cfg.sharding.strategy]
    return [Variant("(as configured)", (), cfg)] + [v for n in names if (v := variants.with_strategy(cfg, n))]


def _tps(cfg: RunConfig) -> list[Variant]:
    # with_tp may switch `none` to ddp (a second sharding= override): tp is tried from the other strategies only.
    if cfg.sharding.strategy == "none":
        return [Variant("", (), cfg)]
    tps = [t for t in (1, 2, 4, 8) if t != cfg.sharding.tp]
    return [Variant("", (), cfg)] + [v for t in tps if (v := variants.with_tp(cfg, t))]


def with_pp(cfg: RunConfig, pp: int) -> Variant | None:
    """`pp` pipeline stages over the same ranks, taken from data parallelism (global batch kept); None where the
    ranks, the layers or the batch do not divide, or the worker does not run the result."""
    s, t = cfg.sharding, cfg.train
    dp = s.dp_replicate * s.dp_shard
    if s.pp != 1 or s.pp_layers or dp % pp or cfg.model.n_layers < pp:
        return None
    replicate = s.strategy in REPLICATING or s.strategy == "none"
    degrees = {"dp_replicate": dp // pp if replicate else 1, "dp_shard": 1 if replicate else dp // pp}
    strategy = "ddp" if s.strategy == "none" and dp // pp > 1 else s.strategy
    for accum in (-1, pp):  # a pipeline wants at least pp micro-batches in flight
        train = {"global_batch": t.global_batch, "grad_accum": accum,
                 "micro_batch": t.micro_batch if accum == -1 else -1}
        candidate = dataclasses.replace(cfg, sharding=dataclasses.replace(s, pp=pp, strategy=strategy, **degrees),
                                        train=dataclasses.replace(t, **train))
        try:
            resolved = resolve(candidate)
        except ConfigError:
            continue
        if resolved.train.grad_accum >= pp and not unsupported(resolved.sharding, resolved.precision):
            return Variant(f"pp={pp}", tuple(changed_keys(cfg, resolved)), resolved)
    return None


def with_cp(cfg: RunConfig, cp: int) -> Variant | None:
    """`cp` context-parallel ranks over the same ranks, taken from (or given back to) data parallelism, the global
    batch kept (the accumulation derived again); None where the ranks do not divide, or validate or the worker
    refuse it. Validate is what keeps cp off a CPU cluster: torch's ring attention replaces the CUDA SDPA kernels
    only (the CPU parity test in tests/dist needs its own ring worker), and it checks the sequence length."""
    s, t = cfg.sharding, cfg.train
    data = s.dp_replicate * s.dp_shard * s.cp  # the ranks cp and data parallelism share
    if s.strategy == "none" or data % cp:  # like tp: tried from the data-parallel strategies only
        return None
    dp = data // cp
    if s.strategy == "hsdp":
        if dp % s.dp_replicate:
            return None
        degrees = {"dp_replicate": s.dp_replicate, "dp_shard": dp // s.dp_replicate}
    else:
        replicate = s.strategy in REPLICATING
        degrees = {"dp_replicate": dp if replicate else 1, "dp_shard": 1 if replicate else dp}
    train = {"global_batch": t.global_batch, "grad_accum": -1, "micro_batch": t.micro_batch}
    candidate = dataclasses.replace(cfg, sharding=dataclasses.replace(s, cp=cp, **degrees),
                                    train=dataclasses.replace(t, **train))
    checked = variants._resolved(f"cp={cp}", [], candidate)  # validate and the worker's support, as every variant
    return checked and Variant(checked.label, tuple(changed_keys(cfg, checked.cfg)), checked.cfg)


def _cps(cfg: RunConfig) -> list[Variant]:
    data = cfg.sharding.dp_replicate * cfg.sharding.dp_shard * cfg.sharding.cp
    cps = [c for c in variants._divisors_up_to(data, MAX_CP) if c != cfg.sharding.cp]
    return [Variant("", (), cfg)] + [v for c in cps if (v := with_cp(cfg, c))]


def _eps(cfg: RunConfig) -> list[Variant]:
    """Expert parallelism over the divisors of dp_shard, for a mixture-of-experts model (validate keeps what splits)."""
    if cfg.model.moe.num_experts == 0:
        return [Variant("", (), cfg)]
    eps = [e for e in variants._divisors_up_to(cfg.sharding.dp_shard, cfg.model.moe.num_experts)
           if e != cfg.sharding.ep]
    return [Variant("", (), cfg)] + [v for e in eps if (v := variants.with_ep(cfg, e))]


def _pps(cfg: RunConfig) -> list[Variant]:
    return [Variant("", (), cfg)] + [v for pp in (2, 4) if (v := with_pp(cfg, pp))]


def _checkpointing(cfg: RunConfig) -> list[Variant]:
    modes = [m for m in AC_MODES if m != cfg.train.activation_checkpointing]
    return [Variant("", (), cfg)] + [v for m in modes if (v := variants.with_checkpointing(cfg, m))]


def _micro_batches(cfg: RunConfig) -> list[Variant]:
    per_rank = cfg.train.micro_batch * cfg.train.grad_accum
    sizes = [b for b in variants._divisors_up_to(per_rank, 64) if b != cfg.train.micro_batch]
    return [Variant("", (), cfg)] + [v for b in sizes if (v := variants.with_micro_batch(cfg, b))]


def start_fills(cfg: RunConfig) -> list[str]:
    """Overrides that make a composed config's layout valid for its cluster, since tune searches the layout anyway:
    the data-parallel degree from the world (tp, pp and cp kept where they divide it), the micro-batch cut to
    divide each rank's share of the global batch, grad_accum derived. Only what changes; the global batch (what
    the run trains on) is never touched: one that the data-parallel ranks do not divide stays validate's to refuse."""
    s, t, c = cfg.sharding, cfg.train, cfg.cluster
    world = c.nodes * c.procs_per_node
    want: dict[str, int] = {}
    model = {k: max(getattr(s, k), 1) for k in ("tp", "pp", "cp")}
    if world % math.prod(model.values()):
        model = dict.fromkeys(model, 1)
    want.update(model)
    dp = world // math.prod(model.values())
    if s.strategy == "hsdp":
        keep = s.dp_replicate if s.dp_replicate > 0 and dp % s.dp_replicate == 0 else 1
        want.update(dp_replicate=keep, dp_shard=dp // keep)
    else:
        replicate = s.strategy in REPLICATING or s.strategy == "none"
        want.update(dp_replicate=dp if replicate else 1, dp_shard=1 if replicate else dp)
    # A degree already -1 is derived by validate as `want` would set it.
    fills = [f"sharding.{k}={v}" for k, v in want.items() if getattr(s, k) not in (v, -1)]
    if t.global_batch > 0 and t.global_batch % dp == 0:
        per_rank = t.global_batch // dp
        largest = min(t.micro_batch, per_rank) if t.micro_batch > 0 else per_rank
        micro = max(b for b in range(1, largest + 1) if per_rank % b == 0)
        fills += [f"train.micro_batch={micro}"] if micro != t.micro_batch else []
        fills += ["train.grad_accum=-1"] if t.grad_accum != -1 else []
    return fills


def layout_key(cfg: RunConfig) -> tuple:
    """What the worker runs differently between candidates (two candidates with one key are one layout)."""
    s, t = cfg.sharding, cfg.train
    return (s.strategy, s.dp_replicate, s.dp_shard, s.tp, s.pp, s.cp, s.cpu_offload, t.activation_checkpointing,
            t.micro_batch, t.grad_accum, s.ep)


def layouts(cfg: RunConfig) -> list[Variant]:
    """Every distinct layout (module doc), the config itself first; at most MAX_CANDIDATES."""
    found = [Variant("(as configured)", (), cfg)]
    for make in (_strategies, _tps, _cps, _eps, _pps, _checkpointing, _micro_batches):
        found = _expand(found, make)
    seen, out = set(), []
    for v in found:
        key = layout_key(v.cfg)
        if key not in seen:
            seen.add(key)
            out.append(v)
    return out[:MAX_CANDIDATES]


def candidate(variant: Variant) -> Candidate:
    cfg = variant.cfg
    a = assess(cfg, dims_of(cfg))
    tokens = cfg.train.tokens_per_step
    predicted = tokens / a.step.total_s if a.step is not None and a.step.total_s > 0 else None
    relative = tokens / a.relative_step.total_s if a.relative_step.total_s > 0 else 0.0
    return Candidate(variant.label, variant.overrides, cfg, a.fit.peak_bytes, a.fit.need_bytes, a.fit.verdict,
                     predicted, relative)


def rank(cfg: RunConfig) -> list[Candidate]:
    """The layouts that fit, fastest predicted first (ties: the fewer changes first, then the smaller peak)."""
    fitting = [c for c in map(candidate, layouts(cfg)) if c.verdict in FITTING]
    speed = (lambda c: c.predicted_tokens_per_s) if all(c.predicted_tokens_per_s for c in fitting) else (
        lambda c: c.relative_speed)
    return sorted(fitting, key=lambda c: (-speed(c), len(c.overrides), c.peak_bytes))
