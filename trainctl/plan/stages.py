"""What each pipeline rank holds and how many micro-batches' activations it keeps at once.

The split itself is the worker's, from trainctl/core/stages.py: `pp x pp_stages_per_rank` stages
of consecutive blocks; pp rank r holds stages r, r + pp, ... (looped placement); stage 0 holds the
embedding, the last stage the final norm and output head.

Micro-batches in flight (forwards done, backwards not yet) on pp rank r with n = grad_accum
micro-batches per step, read from torch.distributed.pipelining's schedules:
    gpipe                     n: every forward runs before the first backward
    1f1b                      min(n, pp - r): warm-up forwards, then one backward before each forward
    interleaved_1f1b          warm-up + 1 stage-chunks, warm-up = (v - 1) * n_round + 2 (pp - 1 - r)
    interleaved_zero_bubble   the same with 1 (pp - 1 - r); its deferred weight gradients keep some
                              inputs a little longer, not counted
where v = stages per rank and n_round = n // max(1, n // pp); each chunk is one of the rank's v
stages, so the rank keeps (chunks / v) of its layers' activations per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainctl.config.schema import ModelConfig, ShardingConfig
from trainctl.core.stages import local_stage_ids, stage_layers


@dataclass(frozen=True)
class RankStages:
    """The part of the model one pp rank holds, and its activation multiplicity."""

    pp_rank: int
    layers: tuple[int, ...]  # global block indices, in order
    first: bool  # holds the embedding
    last: bool  # holds the final norm, the output projection and the loss
    in_flight: float  # micro-batches of this rank's activations alive at once (fractional when interleaved)
    last_in_flight: int  # micro-batches whose logits and log_softmax the last stage keeps at once


def interleaved_warmup(rank: int, pp: int, v: int, n: int, factor: int) -> int:
    """torch's _get_warmup_ops: forward chunks before the first backward of an interleaved schedule."""
    rounds = max(1, n // pp)
    per_round = n // rounds
    return min((v - 1) * per_round + factor * (pp - 1 - rank), n * v)


def in_flight(schedule: str, rank: int, pp: int, v: int, n: int) -> float:
    """Micro-batches of a rank's activations alive at its peak (module doc)."""
    if pp == 1:
        return 1
    if schedule == "gpipe":
        return n
    if schedule == "1f1b":
        return min(n, pp - rank)
    factor = 2 if schedule == "interleaved_1f1b" else 1
    chunks = min(interleaved_warmup(rank, pp, v, n, factor) + 1, n * v)
    return chunks / v


def rank_stages(m: ModelConfig, sharding: ShardingConfig, grad_accum: int) -> list[RankStages]:
    """One entry per pp rank (a single entry without pipeline parallelism)."""
    pp, v = sharding.pp, sharding.pp_stages_per_rank if sharding.pp > 1 else 1
    n_stages = pp * v
    ranges = stage_layers(m.n_layers, n_stages, list(sharding.pp_layers))
    out = []
    for rank in range(pp):
        stage_ids = local_stage_ids(rank, pp, v)
        layers = tuple(i for s in stage_ids for i in ranges[s])
        last = n_stages - 1 in stage_ids
        flight = in_flight(sharding.pp_schedule, rank, pp, v, grad_accum)
        # The last stage runs each micro-batch's backward right after its forward, except under gpipe.
        last_flight = grad_accum if pp > 1 and sharding.pp_schedule == "gpipe" else 1
        out.append(RankStages(rank, layers, 0 in stage_ids, last, flight, last_flight))
    return out
