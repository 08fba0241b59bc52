"""Ranked suggestions for a rank that does not fit (or barely does): each with its memory and its cost.

Candidates, each a config `launch` accepts (variants.py), tried from the current one:
    more checkpointing     every mode that keeps less than the current one (selective, op, full)
    a higher ZeRO stage    zero1 -> zero2 -> zero3 over the same data-parallel ranks
    more tensor parallel   tp x 2 and x 4 within a node, taken from data parallelism
    a smaller micro-batch  half and a quarter, with more accumulation (same global batch)
    CPU offload            zero3 with sharding.cpu_offload=true
When none of them fits alone, each is also tried with full checkpointing on top.
And on more GPUs (more_gpus.py): the same layout with more data-parallel ranks, ZeRO-3 over all of them,
or more pipeline stages, each at the fewest nodes (Slurm) or GPUs of the machine (local) that fit,
found by planning each doubling; these rank after every change that needs no more hardware.
Each is assessed like the config itself: the busiest rank's peak, need and verdict, and the
step time under the throughput model (throughput.py), reported as the change against the
current step time. Ranking: those that fit first (fits, then tight), cheapest first; then the
rest by how much memory they need. Without a device peak (CPU, unknown GPU) the cost is the
ratio of the times at a nominal peak (compute and recompute only: no bandwidth is known).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainctl.config.schema import AC_MODES, RunConfig
from trainctl.plan import variants
from trainctl.plan.assess import Assessment, assess, dims_of
from trainctl.plan.more_gpus import scaled_variants

VERDICT_ORDER = {"fits": 0, "tight": 1, "unknown": 2, "does not fit": 3}


@dataclass(frozen=True)
class Suggestion:
    change: str
    overrides: tuple[str, ...]
    peak_bytes: int
    need_bytes: int
    headroom_bytes: int | None
    verdict: str
    step_time_s: float | None
    slowdown: float | None  # relative change of the step time, +0.33 = 33% slower
    gpus: int | None = None  # the world size, where the change needs more GPUs than the config has

    def to_dict(self) -> dict:
        return dict(self.__dict__, overrides=list(self.overrides))


def candidates(cfg: RunConfig) -> list[variants.Variant]:
    s, t = cfg.sharding, cfg.train
    found: list[variants.Variant | None] = []
    order = list(AC_MODES)
    found += [variants.with_checkpointing(cfg, mode) for mode in order if mode != t.activation_checkpointing]
    if s.strategy in variants.ZERO_ORDER or s.strategy == "none":
        start = variants.ZERO_ORDER.index(s.strategy) + 1 if s.strategy in variants.ZERO_ORDER else 0
        found += [variants.with_strategy(cfg, name) for name in variants.ZERO_ORDER[start:]]
    found += [variants.with_tp(cfg, s.tp * k) for k in (2, 4)]
    found += [variants.with_micro_batch(cfg, t.micro_batch // k) for k in (2, 4) if t.micro_batch % k == 0]
    if not s.cpu_offload:
        found.append(variants.with_strategy(cfg, "zero3", cpu_offload=True))
    return [v for v in found if v is not None]


def combined(variant: variants.Variant, mode: str) -> variants.Variant | None:
    """`variant` with more checkpointing on top (for when no single change is enough)."""
    more = variants.with_checkpointing(variant.cfg, mode)
    if more is None:
        return None
    return variants.Variant(f"{variant.label}, {more.label}", variant.overrides + more.overrides, more.cfg)


def rank_key(s: Suggestion) -> tuple:
    """Fitting ones first (fits before tight), cheapest first, those needing more GPUs after the others that fit
    (fewest GPUs first); the rest by the memory they need."""
    if VERDICT_ORDER[s.verdict] <= 1:
        if s.gpus is not None:
            return (1, s.gpus, VERDICT_ORDER[s.verdict], s.slowdown or 0.0)
        return (0, 0, VERDICT_ORDER[s.verdict], s.slowdown or 0.0)
    return (2, s.need_bytes, 0, 0.0)


def suggest(cfg: RunConfig, current: Assessment, limit: int = 6) -> list[Suggestion]:
    """Ranked suggestions (module doc) that lower the busiest rank's need; at most `limit`."""
    singles, world = candidates(cfg), _world(cfg)
    out = assessed(singles, current, world)
    if not any(VERDICT_ORDER[s.verdict] <= 1 for s in out):
        # No single change is enough: each of the others with full checkpointing on top.
        mode = cfg.train.activation_checkpointing
        pairs = [combined(v, "full") for v in singles if mode != "full" and not v.label.startswith("ac=")]
        out += assessed([p for p in pairs if p is not None], current, world)
    more = [s for s in assessed(scaled_variants(cfg, fits=_fits), current, world) if VERDICT_ORDER[s.verdict] <= 1]
    out = sorted(out + more, key=rank_key)[:limit]
    if more and not any(s.gpus for s in out):
        out[-1:] = [min(more, key=rank_key)]  # how many GPUs would do is always said, when some count does
    return out


def _world(cfg: RunConfig) -> int:
    return cfg.cluster.nodes * cfg.cluster.procs_per_node


def _fits(cfg: RunConfig) -> bool:
    return VERDICT_ORDER[assess(cfg, dims_of(cfg)).fit.verdict] <= 1


def assessed(variants: list[variants.Variant], current: Assessment, world: int = 0) -> list[Suggestion]:
    """A suggestion for each variant that lowers the need, with its figures and cost against `current` (on
    `world` GPUs: a variant on more is marked with its count)."""
    base_time = current.relative_step.total_s
    out = []
    for variant in variants:
        a = assess(variant.cfg, dims_of(variant.cfg))
        if a.fit.need_bytes >= current.fit.need_bytes:
            continue  # only what helps
        slowdown = a.relative_step.total_s / base_time - 1 if base_time else None
        step = None if a.step is None else a.step.total_s
        more = variant_world if (variant_world := _world(variant.cfg)) > world else None
        out.append(Suggestion(variant.label, variant.overrides, a.fit.peak_bytes, a.fit.need_bytes,
                              a.fit.headroom_bytes, a.fit.verdict, step, slowdown, more))
    return out
