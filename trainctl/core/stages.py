"""The pipeline-stage split, shared by the worker (train/parallel/pipeline.py) and the plan (plan/stages.py).

`pp x pp_stages_per_rank` stages of consecutive blocks: `sharding.pp_layers` when given, else an
even split with the remainder on the first stages. pp rank r holds stages r, r + pp, ... (looped
placement); stage 0 holds the embedding, the last stage the final norm and output head.
"""

from __future__ import annotations


def stage_layer_counts(n_layers: int, n_stages: int, pp_layers: list[int]) -> list[int]:
    """Blocks per stage: `pp_layers` if given, else an even split with the remainder on the first stages."""
    if pp_layers:
        return list(pp_layers)
    base, extra = divmod(n_layers, n_stages)
    return [base + (1 if stage < extra else 0) for stage in range(n_stages)]


def stage_layers(n_layers: int, n_stages: int, pp_layers: list[int]) -> list[range]:
    """The global block indices of every stage, in order."""
    ranges, start = [], 0
    for count in stage_layer_counts(n_layers, n_stages, pp_layers):
        ranges.append(range(start, start + count))
        start += count
    assert start == n_layers, (n_layers, pp_layers)
    return ranges


def local_stage_ids(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """Looped placement: rank r holds stages r, r + pp, r + 2 pp, ..."""
    return [pp_rank + k * pp for k in range(stages_per_rank)]
