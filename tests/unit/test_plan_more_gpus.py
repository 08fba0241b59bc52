"""The fit advice says how many GPUs (nodes on Slurm, GPUs of the machine locally) would make a rank fit, found by
planning each doubling, with overrides that give exactly that config."""

from __future__ import annotations

import pytest

from trainctl.config.compose import compose
from trainctl.config.validate import resolve
from trainctl.plan.advice import VERDICT_ORDER, rank_key
from trainctl.plan.assess import assess, dims_of
from trainctl.plan.fit import Machine
from trainctl.plan.more_gpus import scaled_variants
from trainctl.plan.runplan import build, refusal

FITS = ("fits", "tight")
H100_X8 = Machine(("NVIDIA H100 80GB HBM3",) * 8)


def planned(*overrides: str):
    return build(resolve(compose(list(overrides))), machine=H100_X8)


def world(cfg) -> int:
    return cfg.cluster.nodes * cfg.cluster.procs_per_node


@pytest.mark.parametrize(("overrides", "key"), [
    (("recipe=llama7b_fsdp", "model=llama3_70b"), "cluster.nodes="),  # Slurm: more nodes
    (("recipe=llama2_13b_hsdp", "model=llama3_70b"), "cluster.nodes="),
    (("recipe=llama1b_bench", "model=llama3_8b"), "cluster.procs_per_node="),  # local: more GPUs of the machine
])
def test_the_advice_names_a_gpu_count_that_fits_and_its_overrides_give_it(overrides, key):
    plan = planned(*overrides)
    assert plan.fit.verdict == "does not fit"
    more = [a for a in plan.advice if a.gpus]
    assert more, [a.overrides for a in plan.advice]
    for suggestion in more:
        assert suggestion.verdict in FITS and suggestion.gpus > plan.world_size
        assert any(o.startswith(key) for o in suggestion.overrides)
        again = planned(*overrides, *suggestion.overrides)  # what the user gets by adding them
        assert again.fit.verdict in FITS and again.world_size == suggestion.gpus
        assert again.batch.global_batch == plan.batch.global_batch
        assert again.fit.need_bytes == suggestion.need_bytes


def test_each_count_is_planned_and_the_fewest_that_fits_is_named():
    cfg = resolve(compose(["recipe=llama7b_fsdp", "model=llama3_70b"]))
    tried = []

    def fits(candidate) -> bool:
        ok = VERDICT_ORDER[assess(candidate, dims_of(candidate)).fit.verdict] <= 1
        tried.append((world(candidate), ok))
        return ok

    found = scaled_variants(cfg, fits)
    assert found and all(v.cfg.cluster.nodes > cfg.cluster.nodes for v in found)
    # One run of tries per way of spreading (a new run starts again at the smallest count): the counts double,
    # and a run stops at the first count that fits, which is the count the advice names.
    runs: list[list[tuple[int, bool]]] = []
    for count, ok in tried:
        if not runs or count <= runs[-1][-1][0] or runs[-1][-1][1]:
            runs.append([])
        runs[-1].append((count, ok))
    for run in runs:
        counts = [c for c, _ in run]
        assert all(b == 2 * a for a, b in zip(counts, counts[1:], strict=False))
        assert [ok for _, ok in run[:-1]] == [False] * (len(run) - 1)
    assert sorted(world(v.cfg) for v in found) == sorted(run[-1][0] for run in runs if run[-1][1])


def test_more_gpus_rank_after_every_change_that_fits_without_them():
    plan = planned("recipe=llama2_13b_pp")
    fitting = [a for a in plan.advice if a.verdict in FITS]
    assert fitting == sorted(fitting, key=rank_key)
    first_more = next(i for i, a in enumerate(fitting) if a.gpus)
    assert all(a.gpus is None for a in fitting[:first_more]) and first_more > 0
    assert "cluster.nodes=" not in refusal(plan)  # the refusal's hint: the cheapest fitting change


def test_a_cpu_run_is_not_told_to_add_workers():
    cfg = resolve(compose(["model=llama3_8b", "train.seq_len=1024"]))
    assert scaled_variants(cfg, fits=lambda c: True) == []
    assert not any(a.gpus for a in build(cfg, machine=Machine(())).advice)
