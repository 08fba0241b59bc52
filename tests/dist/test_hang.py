"""A hung rank under torchrun (2 gloo workers, CPU): its watchdog dumps the stacks, the group restarts and resumes.

Rank 1 blocks forever in the test hook `hang_forever` once step HANG_STEP is logged (first attempt only); rank 0
blocks in the next step's collective. With a restart left the run completes with exactly the losses of an
uninterrupted run, and result.json counts the restart and its reason. Without one (`trainctl launch`,
cluster.max_restarts=0) it ends FAILED with reason hang, naming the rank and the stack files.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from worker_runs import TINY_OVERRIDES, WORKER_TIMEOUT_S, base_config, records, run_worker, write_run_dir

from tests.faults.worker_faults import fault_env
from tests.helpers import run_cli, run_group, torchrun_cmd, worker_env
from trainctl.config.schema import CheckpointConfig, RunConfig, ShardingConfig
from trainctl.core import hangs, rundir
from trainctl.launch.command import TORCHRUN_ENV

pytestmark = pytest.mark.dist

STEPS, EVERY, HANG_STEP = 8, 2, 5
# Long enough that no step, eval or save of the tiny model comes near it on 2 busy cores; short for the test.
TIMEOUT_S = 10.0


def config(cache: Path, name: str) -> RunConfig:
    cfg = base_config(cache, steps=STEPS, micro_batch=4)  # global batch 8 = 4 x 2 ranks
    return replace(cfg, name=name, sharding=ShardingConfig(strategy="ddp", dp_replicate=2),
                   checkpoint=CheckpointConfig(every=EVERY, keep_last=2),
                   train=replace(cfg.train, hang_timeout_s=TIMEOUT_S))


def final_losses(run_dir: Path) -> dict[int, tuple[float, float]]:
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in records(run_dir, "train")}


def logs_of(run_dir: Path) -> str:
    return "\n".join(p.read_text() for p in sorted((run_dir / "logs").glob("rank*.log")))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_cache) -> Path:
    """The uninterrupted run: no hang files, no restarts."""
    run_dir = write_run_dir(tmp_path_factory.mktemp("hang-reference"), config(data_cache, "reference"))
    proc = run_worker(run_dir, 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not list((run_dir / rundir.HANGS).glob("*")), "a run that never hung left hang files"
    assert json.loads((run_dir / rundir.RESULT).read_text())["restarts"] == 0
    return run_dir


def run_hanging(root: Path, cache: Path, name: str, fork: bool = False, **faults) -> Path:
    """2 workers under torchrun with one restart, the fault injected; the run must complete. fork: the ranks forked
    by trainctl's agent (cluster.rank_start=fork), else plain torchrun's (exec)."""
    run_dir = write_run_dir(root, config(cache, name))
    cmd = torchrun_cmd(2, "-m", "trainctl.train", str(run_dir), max_restarts=1, fork=fork)
    proc = run_group(cmd, WORKER_TIMEOUT_S, worker_env(**TORCHRUN_ENV, **fault_env(**faults)))
    assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n{logs_of(run_dir)[-3000:]}"
    return run_dir


def test_a_hung_rank_is_restarted_and_the_run_matches_an_uninterrupted_one(tmp_path, data_cache, reference):
    run_dir = run_hanging(tmp_path, data_cache, "hung", fork=True, hang_after_step=HANG_STEP)
    assert final_losses(run_dir) == final_losses(reference)  # exact resume: bit for bit
    assert [r["step"] for r in records(run_dir, "resume")] == [HANG_STEP - HANG_STEP % EVERY]
    result = json.loads((run_dir / rundir.RESULT).read_text())
    assert result["restarts"] == 1
    (reason,) = result["restart_reasons"]
    assert reason["attempt"] == 0 and reason["reason"] == "hang" and 1 in reason["ranks"], reason
    found = hangs.hangs(run_dir)
    stuck = [h for h in found if h.rank == 1]
    assert len(stuck) == 1 and stuck[0].attempt.restart == 0 and stuck[0].timeout_s == TIMEOUT_S, found
    stacks = stuck[0].path.read_text()
    assert "Timeout (" in stacks and "hang_forever" in stacks, stacks[-3000:]
    # The second attempt ended normally: its ranks removed their files.
    assert all(h.attempt.restart == 0 for h in found)
    assert not [p for p in (run_dir / rundir.HANGS).iterdir() if ".a1." in p.name]


def test_a_rank_hung_in_setup_is_caught_too(tmp_path, data_cache, reference):
    """Before the first step (after the checkpoint read, in the setup hook): watched like a step."""
    run_dir = run_hanging(tmp_path, data_cache, "setup-hung", hang_in_setup=True)
    assert final_losses(run_dir) == final_losses(reference)  # no checkpoint yet: the restart begins anew
    assert records(run_dir, "resume") == []
    result = json.loads((run_dir / rundir.RESULT).read_text())
    assert result["restarts"] == 1 and result["restart_reasons"][0]["reason"] == "hang", result
    (stuck,) = [h for h in hangs.hangs(run_dir) if h.rank == 1]
    assert "hang_forever" in stuck.path.read_text() and "on_setup" in stuck.path.read_text()


def test_a_hang_without_restarts_ends_failed_with_reason_hang(tmp_path):
    args = ["launch", "recipe=tiny_cpu", *TINY_OVERRIDES, f"data.cache_dir={tmp_path / 'cache'}",
            f"train.steps={STEPS}", "train.eval_every=0", f"checkpoint.every={EVERY}", "logging.log_every=1",
            "schedule.warmup_steps=2", f"train.hang_timeout_s={TIMEOUT_S}", "cluster.max_restarts=0",
            "--name", "hang"]
    proc = run_cli(*args, cwd=tmp_path, timeout=WORKER_TIMEOUT_S, **fault_env(hang_after_step=HANG_STEP))
    run_dir = tmp_path / "runs" / "hang"
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "hung" in last and f"no progress for {TIMEOUT_S:g} s" in last and "rank" in last, last
    stuck = [h for h in hangs.hangs(run_dir) if h.rank == 1]
    assert len(stuck) == 1 and str(stuck[0].path) in last, last
    assert "hang_forever" in stuck[0].path.read_text()
    record = json.loads((run_dir / rundir.LAUNCH).read_text())
    assert record["state"] == "FAILED" and record["failure"]["reason"] == "hang", record
    assert 1 in record["failure"]["ranks"]
    assert not (run_dir / rundir.RESULT).exists()
    assert "Traceback" not in proc.stderr
    status = run_cli("status", "hang", cwd=tmp_path, timeout=60)
    assert "hung" in status.stdout + status.stderr, status.stdout + status.stderr
