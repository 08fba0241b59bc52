"""Resume: a run stopped and resumed equals the run done in one go, bitwise (fp32, gloo, deterministic).

A stop request (the test-side fault stop_after_step acts like the preemption signal)
checkpoints after step 10 and exits; the same run directory launched again resumes from it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from worker_runs import (
    WORKER_TIMEOUT_S,
    base_config,
    records,
    selected,
    selected_functions,
    train_written,
    write_run_dir,
)

from tests.faults.worker_faults import fault_env
from tests.helpers import curve_rel, ranks_cmd, run_group, worker_env
from trainctl.config.schema import CheckpointConfig, GuardsConfig, OptimConfig, ShardingConfig
from trainctl.train.checkpoint.state import quantized_state_classes
from trainctl.train.checkpoint.store import list_committed, verify

pytestmark = pytest.mark.dist

STEPS, STOP_AT = 20, 10


def launch(run_dir: Path, nproc: int | None, **env) -> subprocess.CompletedProcess:
    """The worker on RUN_DIR in fresh processes: N ranks (torchrun's environment, helpers.ranks_cmd), or one plain
    process. The launcher's own resume (`trainctl resume`, torchrun, its restarts) is test_run_lock's and
    test_faults'; here the subject is what the worker reads back."""
    if nproc is None:
        cmd = [sys.executable, "-m", "trainctl.train", str(run_dir)]
    else:
        cmd = ranks_cmd(nproc, "-m", "trainctl.train", str(run_dir))
    return run_group(cmd, WORKER_TIMEOUT_S, worker_env(**env))


def ok(proc: subprocess.CompletedProcess, run_dir: Path) -> None:
    logs = "\n".join(p.read_text() for p in sorted((run_dir / "logs").glob("*.log")))
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{proc.stderr[-3000:]}\n{logs[-3000:]}"


def losses(run_dir: Path) -> dict[int, float]:
    """Loss per step; a resumed attempt's records replace the earlier attempt's for the same steps."""
    return {r["step"]: r["loss"] for r in records(run_dir, "train")}


def final_weights(run_dir: Path, tmp: Path) -> dict[str, torch.Tensor]:
    (step, path), = list_committed(run_dir / "checkpoints")[-1:]
    out = tmp / f"{run_dir.name}-{step}.pt"
    with torch.serialization.safe_globals(_low_bit_states()):  # DCP reads the optimizer's part too
        dcp_to_torch_save(path, out)
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state["model"].items()}


def _low_bit_states() -> list[type]:
    """torchao's quantized optimizer state classes (optim.name=adamw8bit ...), which weights-only loading refuses."""
    try:
        import torchao.optim  # noqa: F401  (imports the classes the checkpoint's allow-list names)
    except ImportError:
        return []
    return quantized_state_classes()


def config(cache, name: str, sharding: ShardingConfig, micro_batch: int, **ckpt):
    cfg = base_config(cache, steps=STEPS, micro_batch=micro_batch, grad_accum=8 // micro_batch // _dp(sharding))
    return replace(cfg, name=name, sharding=sharding, checkpoint=CheckpointConfig(**ckpt))


def _dp(s: ShardingConfig) -> int:
    return max(s.dp_replicate, 1) * max(s.dp_shard, 1)


LAYOUTS = {
    # name: (sharding, workers, micro_batch)
    "ddp": (ShardingConfig(strategy="ddp", dp_replicate=2), 2, 4),
    "zero3": (ShardingConfig(strategy="zero3", dp_shard=2), 2, 4),
    "tp": (ShardingConfig(strategy="none", tp=2), 2, 8),
    # zero1's optimizer shards are per rank (not resharded); pp: names stay the full model's.
    "zero1": (ShardingConfig(strategy="zero1", dp_replicate=2), 2, 4),
    "pp": (ShardingConfig(strategy="none", pp=2, pp_schedule="1f1b"), 2, 4),
}


SINGLE = (ShardingConfig(strategy="none"), None, 8)  # one process: torchao compiles its step once per launch

# (optimizer config, layout, a state entry only it keeps): each optimizer through DCP (zero1: per-rank shards) on
# a layout it runs on, its own states coming back exactly. AdamW is test_stop_and_resume_is_bitwise_identical's.
OPTIMIZER_CASES = {
    "adafactor-ddp": (OptimConfig(name="adafactor", lr=1e-2, weight_decay=0.0), LAYOUTS["ddp"], "col_var"),
    "adafactor-zero1": (OptimConfig(name="adafactor", lr=1e-2, weight_decay=0.0), LAYOUTS["zero1"], "col_var"),
    "adafactor-pp": (OptimConfig(name="adafactor", lr=1e-2, weight_decay=0.0), LAYOUTS["pp"], "col_var"),
    "sgd-tp": (OptimConfig(name="sgd", lr=1e-2, momentum=0.9, nesterov=True), LAYOUTS["tp"], "momentum_buffer"),
    "lion-zero3": (OptimConfig(name="lion", lr=1e-4, beta2=0.99), LAYOUTS["zero3"], "exp_avg"),
    "muon-ddp": (OptimConfig(name="muon", momentum=0.95, nesterov=True), LAYOUTS["ddp"], "momentum_buffer"),
    "adamw8bit-single": (OptimConfig(name="adamw8bit"), SINGLE, "exp_avg_sq"),
    "adamw8bit-ddp": (OptimConfig(name="adamw8bit"), LAYOUTS["ddp"], "exp_avg_sq"),  # its one multi-rank layout
}
# adamw8bit's step is torch.compile'd: compiled code and its caches live in the process, so each of its pairs trains
# in processes of its own, as it would in a launch; it is slow, and trains only when the slow tier runs.
OWN_PROCESSES = {"adamw8bit-single", "adamw8bit-ddp"}


def case_run(data_cache, case: str):
    """`run(name)` of a case (a layout of LAYOUTS with AdamW, or an OPTIMIZER_CASES id) and its world size."""
    if case in LAYOUTS:
        (sharding, nproc, micro), optim = LAYOUTS[case], None
    else:
        optim, (sharding, nproc, micro), _ = OPTIMIZER_CASES[case]

    def run(name):
        cfg = config(data_cache, name, sharding, micro)
        return cfg if optim is None else replace(cfg, optim=optim)

    return run, nproc


def straight_and_stopped(root: Path, cases: dict[str, tuple], stop_at: int) -> tuple[dict[str, tuple[Path, Path]],
                                                                                      list[str]]:
    """Per case (name -> (run, nproc)), a run straight through and a run stopped after `stop_at` (the stop_after_step
    fault: a stop request, no signal, exit 0), each still in its first process; and the failures of the launches.

    The straight runs of one world size train in one process per rank, and so do the stopped ones: each run seeds
    itself and builds its own model, optimizer, data and stop flag, so its numbers are a fresh process's (the bitwise
    comparison with the resume, which always starts a new process, would show otherwise). A launch that fails stops
    at its failing run; the failure is returned, not raised, so that each test fails only if its own pair is missing
    (a case that one torch release cannot run does not take the others down)."""
    pairs = {case: tuple(write_run_dir(root / case, run(name)) for name in ("straight", "resumed"))
             for case, (run, _) in cases.items()}
    failures = []
    for which, env in ((0, {}), (1, fault_env(stop_after_step=stop_at))):
        with pytest.MonkeyPatch.context() as patch:
            for name, value in env.items():
                patch.setenv(name, value)
            try:
                train_written({case: (pair[which], cases[case][1]) for case, pair in pairs.items()})
            except AssertionError as failure:
                failures.append(str(failure))
    return pairs, failures


def resumed_equals_straight(tmp_path, pair: tuple[Path, Path], failures: list[str], nproc, stop_at: int,
                            steps: int) -> None:
    """The stopped run of `pair` resumed in a new process (as after a real stop): every loss and the final weights
    bitwise those of the straight run."""
    straight, resumed = pair
    for failure in failures:  # a shared launch that failed: only by another run, named (many_runs_worker.py)
        named = re.search(r"many_runs_worker: (\S+) failed", failure)
        assert named and named[1] not in (str(straight), str(resumed)), failure
    trained = (straight / "result.json").is_file() and list_committed(resumed / "checkpoints")
    assert trained, f"{straight.parent.name}: the shared launch stopped before its runs:\n" + "\n".join(failures)
    assert not (resumed / "result.json").exists()  # stopped early: no result yet
    assert [s for s, _ in list_committed(resumed / "checkpoints")] == [stop_at]
    ok(launch(resumed, nproc), resumed)
    assert [r["step"] for r in records(resumed, "resume")] == [stop_at]
    assert losses(resumed) == losses(straight) and len(losses(straight)) == steps  # every step, exactly
    a, b = final_weights(straight, tmp_path), final_weights(resumed, tmp_path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def stopped_and_resumed_equals_straight(tmp_path, run, nproc, stop_at: int, steps: int) -> tuple[Path, Path]:
    """`run(name)`'s config trained straight, and again stopped after `stop_at` and resumed, in processes of its
    own: every loss and the final weights bitwise equal; the two run directories (straight, resumed)."""
    pair_of, failures = straight_and_stopped(tmp_path, {"own": (run, nproc)}, stop_at)
    resumed_equals_straight(tmp_path, pair_of["own"], failures, nproc, stop_at, steps)
    return pair_of["own"]


def selected_cases(request) -> list[str]:
    """The layouts and optimizer cases (not trained in their own processes) of this module's selected tests: the
    shared launches train only what the session runs (a -k that picks a few cases does not pay for the rest)."""
    chosen = selected(request, "layout", LAYOUTS) + selected(request, "case", OPTIMIZER_CASES)
    return [case for case in chosen if case not in OWN_PROCESSES]


@pytest.fixture(scope="module")
def pairs(request, tmp_path_factory, data_cache):
    """The straight and stopped runs of the selected layout and optimizer cases, and the shared launches' failures."""
    cases = {case: case_run(data_cache, case) for case in selected_cases(request)}
    return straight_and_stopped(tmp_path_factory.mktemp("resume"), cases, STOP_AT)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_stop_and_resume_is_bitwise_identical(pairs, tmp_path, layout):
    pair_of, failures = pairs
    resumed_equals_straight(tmp_path, pair_of[layout], failures, LAYOUTS[layout][1], STOP_AT, STEPS)
    result = json.loads((pair_of[layout][1] / "result.json").read_text())
    assert result["resumed_from_step"] == STOP_AT and result["steps"] == STEPS


@pytest.mark.parametrize("case", [pytest.param(case, marks=[pytest.mark.slow] if case in OWN_PROCESSES else [])
                                  for case in OPTIMIZER_CASES], ids=list(OPTIMIZER_CASES))
def test_each_optimizer_stop_and_resume_is_bitwise_identical(request, tmp_path, data_cache, case):
    """optim.name=NAME: its states go through the checkpoint and come back exactly."""
    run, nproc = case_run(data_cache, case)
    if case in OWN_PROCESSES:
        _, resumed = stopped_and_resumed_equals_straight(tmp_path, run, nproc, STOP_AT, STEPS)
    else:
        pair_of, failures = request.getfixturevalue("pairs")
        resumed_equals_straight(tmp_path, pair_of[case], failures, nproc, STOP_AT, STEPS)
        resumed = pair_of[case][1]
    assert OPTIMIZER_CASES[case][2] in _optimizer_state_keys(resumed)  # the states in the checkpoint were its own


def _optimizer_state_keys(run_dir: Path) -> set[str]:
    """Names of the optimizer state entries of the newest checkpoint: DCP's, or zero1's per-rank shards."""
    (_, path), = list_committed(run_dir / "checkpoints")[-1:]
    keys = {k.rsplit(".", 1)[-1] for k in FileSystemReader(str(path)).read_metadata().state_dict_metadata}
    for rank_file in path.glob("rank-*.pt"):
        shard = torch.load(rank_file, weights_only=False).get("zero1_shard", {"state": {}})
        keys |= {name for state in shard["state"].values() for name in state}
    return keys


@pytest.fixture(scope="module")
def four_worker_runs(tmp_path_factory, data_cache):
    """zero3 on 4 workers: one run straight through, one stopped after step 10 (its checkpoint is the source)."""
    root = tmp_path_factory.mktemp("reshard")
    z4 = ShardingConfig(strategy="zero3", dp_shard=4)
    straight = write_run_dir(root, config(data_cache, "z4-straight", z4, 2))
    ok(launch(straight, 4), straight)
    source = write_run_dir(root, config(data_cache, "z4-stopped", z4, 2))
    ok(launch(source, 4, **fault_env(stop_after_step=STOP_AT)), source)
    return root, straight, source


RESHARD_TARGETS = {
    "zero3x2": (ShardingConfig(strategy="zero3", dp_shard=2), 2, 4),
    "single": (ShardingConfig(), None, 8),
    "fsdp2+tp2": (ShardingConfig(strategy="fsdp", dp_shard=2, tp=2), 4, 4),
}


@pytest.fixture(scope="module")
def from_four(request, four_worker_runs, data_cache):
    """New runs from the 4-worker run's checkpoint: one per selected resharding target with everything (step, data
    position too), and one from its weights only (load_only=model) when its test runs; those of one world size in
    one process per rank."""
    root, _, source = four_worker_runs
    checkpoint = list_committed(source / "checkpoints")[-1][1]
    cases = {}
    for target in selected(request, "target", RESHARD_TARGETS):
        sharding, nproc, micro = RESHARD_TARGETS[target]
        cfg = config(data_cache, f"from-4-{target}", sharding, micro, resume=str(checkpoint), load_only="all")
        cases[target] = (write_run_dir(root, cfg), nproc)
    if "test_load_only_model_starts_a_fresh_run_from_the_weights" in selected_functions(request):
        finetune = config(data_cache, "finetune", ShardingConfig(), 8, resume=str(source), load_only="model")
        cases["finetune"] = (write_run_dir(root, finetune), None)
    train_written(cases)
    return {name: run_dir for name, (run_dir, _) in cases.items()}


@pytest.mark.parametrize("target", list(RESHARD_TARGETS))
def test_resharded_resume_continues_the_loss(four_worker_runs, from_four, target):
    _, straight, _ = four_worker_runs
    run_dir, nproc = from_four[target], RESHARD_TARGETS[target][1]
    got, want = losses(run_dir), losses(straight)
    assert sorted(got) == list(range(STOP_AT + 1, STEPS + 1))
    # Resharding changes the order of floating-point sums: rounding's bound for the steps so far, not bitwise.
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=curve_rel(step)), step
    log = (run_dir / "logs" / "rank0.log").read_text()
    assert "resharded" in log or nproc == 4


def test_load_only_model_starts_a_fresh_run_from_the_weights(four_worker_runs, from_four):
    _, straight, _ = four_worker_runs
    got = losses(from_four["finetune"])
    assert sorted(got) == list(range(1, STEPS + 1))  # a fresh schedule from step 0
    # Its first loss is that of trained weights (well below the untrained run's first loss).
    assert got[1] < losses(straight)[1] - 0.5


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_nan_at_a_chosen_step(tmp_path, data_cache, policy):
    sharding, nproc, micro = LAYOUTS["ddp"]
    cfg = config(data_cache, f"nan-{policy}", sharding, micro, every=4)
    cfg = replace(cfg, guards=GuardsConfig(nonfinite=policy))
    run_dir = write_run_dir(tmp_path, cfg)
    proc = launch(run_dir, nproc, **fault_env(nan_at_step=7))
    log = (run_dir / "logs" / "rank0.log").read_text()
    if policy == "stop":
        assert proc.returncode != 0 and "Traceback" not in log
        errors = [line for line in log.splitlines() if " ERROR " in line]
        assert len(errors) == 1 and "step 7" in errors[0] and "not finite" in errors[0], errors
        assert max(losses(run_dir)) == 6  # stopped at step 7, before its update and its log line
        assert [s for s, _ in list_committed(run_dir / "checkpoints")] == [4]
        assert verify(list_committed(run_dir / "checkpoints")[-1][1]) == []
    else:
        ok(proc, run_dir)
        result = json.loads((run_dir / "result.json").read_text())
        assert result["guard_skipped_steps"] == 1 and result["steps"] == STEPS
        assert all(v == v for s, v in losses(run_dir).items() if s != 7)  # only the injected step is NaN


def test_async_save_gives_the_same_run_and_valid_checkpoints(tmp_path, data_cache):
    sharding, nproc, micro = LAYOUTS["zero3"]
    sync = write_run_dir(tmp_path, config(data_cache, "sync", sharding, micro, every=5))
    run_dir = write_run_dir(tmp_path, config(data_cache, "async", sharding, micro, every=5, async_save=True))
    train_written({"sync": (sync, nproc), "async": (run_dir, nproc)})  # one launch; the async run last
    assert losses(run_dir) == losses(sync)
    committed = list_committed(run_dir / "checkpoints")
    assert [s for s, _ in committed] == [15, 20] and all(verify(p) == [] for _, p in committed)
    saves = records(run_dir, "checkpoint")
    assert [r["step"] for r in saves] == [5, 10, 15, 20] and all(r["blocking_s"] <= r["total_s"] for r in saves)


def test_stop_and_resume_inside_the_batch_ramp_is_bitwise_identical(tmp_path, data_cache):
    """train.batch_ramp: stopped at a step inside the ramp and resumed, every step's loss and the final weights are
    the uninterrupted run's, and metrics.jsonl carries each step's planned global batch and its lr on the tokens
    clock (core/batch_ramp.py)."""
    from trainctl.config.schema import BatchRampConfig
    from trainctl.core.batch_ramp import BatchRamp
    from trainctl.core.schedules import lr_at

    sharding, nproc, stop_at, steps = ShardingConfig(strategy="ddp", dp_replicate=2), 2, 5, 12

    def run(name):  # global 8 = micro 1 x accum 4 x dp 2; the ramp starts at 2 (accum 1) and grows over 8 steps
        cfg = config(data_cache, name, sharding, 1)
        return replace(cfg, train=replace(cfg.train, steps=steps, eval_every=steps,
                                          batch_ramp=BatchRampConfig(start=2, steps=8)))

    straight, resumed = stopped_and_resumed_equals_straight(tmp_path, run, nproc, stop_at, steps)
    ramp, cfg = BatchRamp.of(run("x").train, 2), run("x")
    assert ramp.accum_at(stop_at) < ramp.final_accum  # the stop was inside the ramp
    for r in records(resumed, "train"):
        assert r["global_batch"] == ramp.batch_at(r["step"] - 1) and r["tokens"] == r["global_batch"] * 64
        assert r["tokens_seen"] == ramp.sequences_before(r["step"]) * 64
        lr = lr_at(ramp.position(r["step"] - 1), cfg.optim.lr, cfg.schedule, ramp.schedule_length())
        assert r["lr"] == lr
    assert [r["global_batch"] for r in records(straight, "train")][:9] == [2, 2, 2, 4, 4, 4, 6, 6, 8]
    assert [r["step"] for r in records(straight, "memory")] == [11]  # measured at the full batch, as planned


def test_a_streamed_hugging_face_dataset_stops_and_resumes_bitwise(tmp_path, data_cache):
    """data=hf streaming a jsonl file on two DDP ranks: each rank's stream position comes back from its part of the
    checkpoint, so the resumed run reads the same windows (losses and weights bitwise) as the uninterrupted one."""
    pytest.importorskip("datasets")
    rows = [{"text": f"def function_{i}(x):\n    return x * {i} + {i % 7}\n" * (i % 5 + 1)} for i in range(64)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    from trainctl.config.schema import DataConfig

    data = DataConfig(kind="hf", source=str(tmp_path / "rows.jsonl"), streaming=True, tokenizer="bytes",
                      vocab_size=256, val_split="validation")
    sharding, nproc, stop_at, steps = ShardingConfig(strategy="ddp", dp_replicate=2), 2, 4, 8

    def run(name):  # global 8 = micro 2 x accum 2 x dp 2: each rank packs 4 windows of 65 bytes a step
        cfg = config(data_cache, name, sharding, 2)
        return replace(cfg, data=data, train=replace(cfg.train, steps=steps, eval_every=steps))

    stopped_and_resumed_equals_straight(tmp_path, run, nproc, stop_at, steps)
