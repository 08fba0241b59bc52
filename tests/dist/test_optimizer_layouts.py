"""Each optimizer's curve under every layout that holds its state equals one process's, to rounding.

The same global batch of 8 (fp32, gloo) trained by one process and split over 2 ranks: data parallelism (ddp),
ZeroRedundancyOptimizer's partition (zero1), FSDP2's dim-0 shards (zero3) and tensor parallelism (tp=2). The
optimizer sees the same gradients up to the order of their sums, so its updates, and the next steps' losses, agree to
rounding's bound (tests.helpers.curve_rel). Muon under zero3 and tp gathers each sharded matrix for Newton-Schulz
(train/muon.py): a wrong shard kept, or a shard orthogonalized alone, moves the curve by far more than rounding.
Each optimizer's checkpoint from 2 ranks (zero3; adafactor, adamw8bit: ddp) resumes in one process (DCP reshards the model and
the optimizer's states) and continues the 2-rank curve to rounding.
The runs on 2 ranks train in two launches (many_runs_worker.py), the one-process runs in a third.
AdamW's layouts are test_parity's and test_resume's. torchao's 8-bit AdamW steps whole tensors only: ddp here (zero1,
zero3 and tp are refused before launch, tests/unit/test_optimizers.py); its quantized states (codes, block scales, code
map) are whole tensors on every rank, so DCP saves them once and loads them into one process as they were.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from worker_runs import base_config, series, train_many

from tests.helpers import assert_curve_close
from trainctl.config.schema import CheckpointConfig, OptimConfig, ShardingConfig
from trainctl.train.checkpoint.store import list_committed

pytestmark = pytest.mark.dist

STEPS, SAVED_AT = 4, 2
OPTIMIZERS = {
    "sgd": OptimConfig(name="sgd", lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1, grad_clip=1.0),
    "lion": OptimConfig(name="lion", lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=1.0, grad_clip=1.0),
    "muon": OptimConfig(name="muon", lr=2e-2, momentum=0.95, nesterov=True, weight_decay=0.1, grad_clip=1.0),
    "adafactor": OptimConfig(name="adafactor", lr=1e-2, weight_decay=0.0, grad_clip=1.0),
    "adamw8bit": OptimConfig(name="adamw8bit", lr=1e-3, weight_decay=0.1, grad_clip=1.0),
}
# layout -> (sharding, micro_batch, grad_accum): 8 sequences a step on 2 ranks
LAYOUTS = {
    "ddp": (ShardingConfig(strategy="ddp", dp_replicate=2), 2, 2),
    "zero1": (ShardingConfig(strategy="zero1", dp_replicate=2), 4, 1),
    "zero3": (ShardingConfig(strategy="zero3", dp_shard=2), 2, 2),
    "tp": (ShardingConfig(strategy="none", tp=2), 8, 1),
}
# What core/optimizers.py lets each run on (the others are refused before launch: tests/unit/test_optimizers.py).
REFUSED = {"muon": ("zero1",), "adafactor": ("zero3", "tp"), "adamw8bit": ("zero1", "zero3", "tp")}
CASES = [(name, layout) for name in OPTIMIZERS for layout in LAYOUTS if layout not in REFUSED.get(name, ())]


def compiled(name: str) -> list:
    """torchao compiles the low-bit AdamW's step (Inductor, a C++ compiler per tensor shape, in every process): its
    cases train in the shared launch only when the slow tier selects them (about 100 s more, CPU)."""
    return [pytest.mark.slow] if name == "adamw8bit" else []


# The layout each optimizer's checkpoint is resharded from (to one process).
RESHARD_FROM = {"sgd": "zero3", "lion": "zero3", "muon": "zero3", "adafactor": "ddp", "adamw8bit": "ddp"}


def run_config(cache, optim: OptimConfig, layout: str | None, **checkpoint):
    sharding, micro, accum = LAYOUTS[layout] if layout else (ShardingConfig(), 8, 1)
    cfg = base_config(cache, steps=STEPS, micro_batch=micro, grad_accum=accum, eval_every=0)
    if RESHARD_FROM.get(optim.name) == layout:  # a checkpoint mid-run, for the one-process resume
        checkpoint = {"every": SAVED_AT, **checkpoint}
    return replace(cfg, optim=optim, sharding=sharding, checkpoint=CheckpointConfig(**checkpoint))


def selected(request) -> list[tuple[str, str]]:
    """The cases of this module's selected tests (a resharding test selects its source): a -k that picks a few
    does not pay for the rest."""
    ids = {item.callspec.id for item in request.session.items
           if item.module is request.module and getattr(item, "callspec", None)}
    return [(name, layout) for name, layout in CASES if {f"{name}-{layout}", f"{name}-from-{layout}"} & ids]


# The 2-rank runs in two torchruns (each well under 20 s on 2 cores), the one-process references in one process.
LAUNCHES = (("sgd", "lion", "adamw8bit"), ("muon", "adafactor"))


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, data_cache) -> dict:
    """The selected cases on 2 ranks and their optimizers in one process; name-layout or name-single -> run dir."""
    root, chosen, out = tmp_path_factory.mktemp("optimizer-layouts"), selected(request), {}
    singles = {f"{name}-single": (run_config(data_cache, OPTIMIZERS[name], None), None)
               for name in dict.fromkeys(name for name, _ in chosen)}
    for names in LAUNCHES:
        cases = {f"{name}-{layout}": (run_config(data_cache, OPTIMIZERS[name], layout), 2)
                 for name, layout in chosen if name in names}
        out |= train_many(root, cases) if cases else {}
    for name, layout in chosen:  # from the 2-rank run's mid-run checkpoint, everything (step, data, optimizer)
        if RESHARD_FROM[name] == layout:
            (path,) = [path for step, path in list_committed(out[f"{name}-{layout}"] / "checkpoints")
                       if step == SAVED_AT]
            singles[f"{name}-from-{layout}"] = (run_config(data_cache, OPTIMIZERS[name], None, resume=str(path),
                                                           load_only="all"), None)
    return out | train_many(root, singles)


@pytest.mark.parametrize(("name", "layout"), [pytest.param(n, lay, id=f"{n}-{lay}", marks=compiled(n))
                                            for n, lay in CASES])
def test_each_optimizer_under_each_layout_matches_one_process(runs, name, layout):
    reference = runs[f"{name}-single"]
    want = series(reference, "loss")
    assert len(want) == STEPS and len(set(want)) == STEPS  # a constant curve would match anything
    for key in ("loss", "grad_norm"):
        assert_curve_close(series(runs[f"{name}-{layout}"], key), series(reference, key), key)



@pytest.mark.parametrize("name", [pytest.param(n, id=f"{n}-from-{lay}", marks=compiled(n))
                                  for n, lay in RESHARD_FROM.items()])
def test_each_optimizers_checkpoint_resumes_resharded_to_one_process(runs, name):
    """Its states resharded from 2 ranks to 1 (DCP): the steps after the checkpoint are the 2-rank run's, to rounding
    (a fresh optimizer state, or another rank's shard, would move them by far more)."""
    source, resumed = runs[f"{name}-{RESHARD_FROM[name]}"], runs[f"{name}-from-{RESHARD_FROM[name]}"]
    steps = list(range(SAVED_AT + 1, STEPS + 1))
    assert [r for r in series(resumed, "step")] == steps
    assert "resharded" in (resumed / "logs" / "rank0.log").read_text()
    for key in ("loss", "grad_norm"):
        assert_curve_close(series(resumed, key), series(source, key)[SAVED_AT:], key, steps)


# 4 ranks: FSDP2 over tp's shards (2-D placements) and HSDP (replicated shards); a launch of its own, so slow.
FOUR_RANKS = {"fsdp+tp": (ShardingConfig(strategy="fsdp", dp_shard=2, tp=2), 4),
              "hsdp2x2": (ShardingConfig(strategy="hsdp", dp_replicate=2, dp_shard=2), 2)}


@pytest.mark.slow
def test_muon_on_four_ranks_matches_one_process(tmp_path, data_cache):
    single = run_config(data_cache, OPTIMIZERS["muon"], None)
    cases = {name: (replace(single, sharding=sharding, train=replace(single.train, micro_batch=micro)), 4)
             for name, (sharding, micro) in FOUR_RANKS.items()}
    runs = train_many(tmp_path, {**cases, "single": (single, None)})
    for name in FOUR_RANKS:
        assert_curve_close(series(runs[name], "loss"), series(runs["single"], "loss"), "loss")
