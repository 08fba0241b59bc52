"""trainctl on a real Slurm (two nodes on this machine): submit, run across nodes, status, logs, cancel.

Every job is the tiny model for a few steps with one thread per worker (the machine has two
cores, and each node claims both), so a job takes seconds after its Python start-up.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import run_cli, start_cli, wait_for
from trainctl.runs import registry as runs

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]

JOB_TIMEOUT_S = 240
FAST = [
    "recipe=tiny_cpu",
    "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
    "model.max_seq_len=64",
    "train.seq_len=64", "train.global_batch=8", "train.micro_batch=4", "train.eval_every=0", "train.eval_batches=2",
    "schedule.warmup_steps=1", "logging.log_every=1", "logging.progress=false",
]  # fmt: skip
# The job's Python is this interpreter: `python` on the nodes' PATH has no torch (cluster.python's default).
SLURM_CPU = ["cluster=slurm", "cluster.device=cpu", "cluster.gpu=", "cluster.cpu_threads=1", "cluster.max_restarts=0",
             "cluster.time_limit=10", f"cluster.python={sys.executable}"]


trainctl = run_cli


def launch(cwd: Path, name: str, *overrides: str) -> Path:
    done = trainctl("launch", *FAST, *overrides, "--name", name, cwd=cwd, timeout=JOB_TIMEOUT_S)
    assert done.returncode == 0, f"launch failed:\n{done.stdout}\n{done.stderr}"
    return cwd / "runs" / name


def cluster_report(run_dir: Path) -> str:
    """What Slurm and the run say, for a failure message."""
    queue = subprocess.run(["squeue", "--states=all", "--long"], capture_output=True, text=True).stdout
    nodes = subprocess.run(["sinfo", "-N", "-l"], capture_output=True, text=True).stdout
    return f"{runs.run_state(run_dir)}\n{queue}\n{nodes}\n{failure_report(run_dir)}"


def wait_on_slurm(predicate, what: str, run_dir: Path, timeout: float = JOB_TIMEOUT_S):
    """The predicate's first true value; on a timeout the test fails with what Slurm and the run say."""
    return wait_for(predicate, what, timeout, report=lambda: cluster_report(run_dir), interval=0.5)


def wait_done(run_dir: Path) -> runs.RunState:
    def finished():
        state = runs.run_state(run_dir)
        return None if state.active else state

    return wait_on_slurm(finished, f"run {run_dir.name} to end", run_dir)


def train_losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"]


def rank_hosts(run_dir: Path) -> set[str]:
    hosts = set()
    for log in (run_dir / "logs").glob("rank*.log"):
        for line in log.read_text().splitlines():
            if " on host " in line:
                hosts.add(line.split(" on host ")[1].split(",")[0])
    return hosts


def failure_report(run_dir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((run_dir / "logs").glob("*.*")))


def test_one_node_job_completes_with_its_logs_and_records(tmp_path):
    run_dir = launch(tmp_path, "one-node", *SLURM_CPU, "cluster.procs_per_node=2", "train.steps=4")
    job_id = json.loads((run_dir / "launch.json").read_text())["job_id"]
    state = wait_done(run_dir)
    assert state.state == "COMPLETED", failure_report(run_dir)
    assert json.loads((run_dir / "result.json").read_text())["steps"] == 4
    assert f"trainctl: job {job_id} attempt 0" in (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert "final step" in (run_dir / "logs" / f"slurm-{job_id}.0.out").read_text()
    records = [json.loads(line) for line in (run_dir / "slurm-attempts.jsonl").read_text().splitlines()]
    assert [(r["event"], r["exit_code"]) for r in records] == [("start", None), ("end", 0)]


def test_two_nodes_give_the_losses_of_two_local_workers(tmp_path):
    steps = "train.steps=6"
    two_nodes = launch(tmp_path, "two-nodes", *SLURM_CPU, "cluster.nodes=2", "cluster.procs_per_node=1", steps)
    local = launch(tmp_path, "local", "cluster=local", "cluster.procs_per_node=2", "cluster.cpu_threads=1", steps)
    state = wait_done(two_nodes)
    assert state.state == "COMPLETED", failure_report(two_nodes)
    assert rank_hosts(two_nodes) == {"node1", "node2"}, "each node should host one rank"
    slurm_losses, local_losses = train_losses(two_nodes), train_losses(local)
    assert len(slurm_losses) == 6
    assert slurm_losses == pytest.approx(local_losses, rel=1e-5)


def test_status_logs_and_cancel_a_running_job(tmp_path):
    run_dir = launch(tmp_path, "long", *SLURM_CPU, "cluster.nodes=2", "cluster.procs_per_node=1", "train.steps=100000")
    def trained_or_ended():
        state = runs.run_state(run_dir)
        return state if (state.step or 0) >= 2 or not state.active else None

    state = wait_on_slurm(trained_or_ended, "two training steps", run_dir)
    assert state.active, f"the job ended early\n{cluster_report(run_dir)}"

    status = trainctl("status", "long", cwd=tmp_path)
    assert status.returncode == 0 and "RUNNING" in status.stdout and "node[1-2]" in status.stdout
    assert "step 1/" in trainctl("logs", "long", cwd=tmp_path).stdout
    assert "rank1" in trainctl("logs", "long", "--rank", "1", cwd=tmp_path).stdout
    follower = start_cli("logs", "long", "--follow", cwd=tmp_path)

    cancelled = trainctl("cancel", "long", cwd=tmp_path)
    assert cancelled.returncode == 0 and "cancelled Slurm job" in cancelled.stdout, cancelled.stderr
    assert wait_done(run_dir).state == "CANCELLED"
    try:
        followed, _ = follower.communicate(timeout=60)  # --follow ends by itself once the job has ended
    except subprocess.TimeoutExpired:
        follower.kill()
        raise AssertionError(f"logs --follow kept going after the job ended\n{cluster_report(run_dir)}") from None
    assert follower.returncode == 0 and "step 2/" in followed
    listing = trainctl("runs", cwd=tmp_path).stdout
    assert any(line.split()[:1] == ["long"] and "CANCELLED" in line for line in listing.splitlines()), listing
    again = trainctl("cancel", "long", cwd=tmp_path)
    assert again.returncode == 2 and "nothing to cancel" in again.stderr


def test_a_job_sbatch_refuses_is_a_one_line_error(tmp_path):
    done = trainctl("launch", *FAST, *SLURM_CPU, "cluster.partition=nosuchpartition", "--name", "refused", cwd=tmp_path)
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(errors) == 1, done.stderr
    assert "sbatch rejected" in errors[0] and "invalid partition" in errors[0].lower()


def _last_per_step(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"}


REQUEUE_SETTLE_S = 3.0  # see _requeued_and_released
_pending_since: dict[tuple[str, str], float] = {}


def _requeued_and_released(job_id: str, run_dir: Path) -> bool:
    """True once the job is back in the queue (then released) or already runs again.

    slurmctld holds a requeued job for a fixed ~120 s (BeginTime) before it may start again;
    the test moves that begin time to now instead of sleeping through it, but not in the second of the
    requeue: slurmd refuses a job whose credential is not newer than its revocation, to the second
    ("Killing non-startable batch job: Job credential revoked"), and the job then ends for good.
    """
    state = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T %r"], capture_output=True, text=True).stdout.split()
    if state[:2] == ["PENDING", "BeginTime"]:
        shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
        restarts = re.search(r"Restarts=(\d+)", shown)
        first_seen = _pending_since.setdefault((job_id, restarts.group(1) if restarts else "?"), time.monotonic())
        if time.monotonic() - first_seen < REQUEUE_SETTLE_S:
            return False
        released = subprocess.run(["scontrol", "update", f"jobid={job_id}", "starttime=now"],
                                  capture_output=True, text=True)
        assert released.returncode == 0, released.stderr
        return True
    attempts = run_dir / "slurm-attempts.jsonl"
    return attempts.exists() and any(json.loads(line).get("attempt") == 1 for line in attempts.read_text().splitlines())


def test_preemption_signal_checkpoints_requeues_and_resumes(tmp_path):
    # Long enough that the signal (it takes a few hundred ms to reach the workers) lands mid-run: 10 ms steps.
    total = 300
    steps = f"train.steps={total}"
    run_dir = launch(tmp_path, "preempted", *SLURM_CPU, "cluster.nodes=2", "cluster.procs_per_node=1", steps)
    job_id = json.loads((run_dir / "launch.json").read_text())["job_id"]
    wait_on_slurm(lambda: len(_last_per_step(run_dir)) >= 5 if (run_dir / "metrics.jsonl").exists() else False,
             "5 training steps", run_dir)
    # The early warning Slurm sends before the time limit, sent now to every job step (as --signal does).
    sent = subprocess.run(["scancel", "--signal=USR2", job_id], capture_output=True, text=True)
    assert sent.returncode == 0, sent.stderr
    local = launch(tmp_path, "local-ref", "cluster=local", "cluster.procs_per_node=2", "cluster.cpu_threads=1", steps)
    wait_on_slurm(lambda: _requeued_and_released(job_id, run_dir), "the job to be requeued", run_dir)
    wait_on_slurm(lambda: (run_dir / "result.json").is_file(), "the requeued job to finish", run_dir,
             timeout=2 * JOB_TIMEOUT_S)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    resumes = [r for r in records if r["kind"] == "resume"]
    assert len(resumes) == 1, failure_report(run_dir)
    stopped_at = resumes[0]["step"]
    assert 5 <= stopped_at < total
    attempts = [json.loads(line) for line in (run_dir / "slurm-attempts.jsonl").read_text().splitlines()]
    assert {r["attempt"] for r in attempts if r["event"] == "start"} == {0, 1}, attempts
    result = json.loads((run_dir / "result.json").read_text())
    assert result["resumed_from_step"] == stopped_at and result["steps"] == total
    # Checkpoint, requeue, resume: the same losses at every step as a run never interrupted.
    want = _last_per_step(local)
    assert _last_per_step(run_dir) == pytest.approx(want, rel=1e-5)
    assert result["final_train_loss"] == pytest.approx(want[total], rel=1e-5)


# A container stand-in: a prefix that changes the environment of whatever it runs, then execs it. Each worker rank
# (started by an agent under it, as a new interpreter or forked) runs the test hook of HOOKS (the worker's
# TRAINCTL_TEST_HOOKS, train/loop/hooks.py), which records what the rank saw.
WRAPPER = """#!/usr/bin/env bash
echo "$(hostname) $*" >> "$MARKS/wrapper.log"
export CONTAINER_MARK="inside-$(hostname)"
export PYTHONPATH="$HOOKS${PYTHONPATH:+:$PYTHONPATH}"
# Like `apptainer exec [--options] IMAGE COMMAND...`: its own words first.
[ "$1" = exec ] || { echo "fake-apptainer: usage: exec [--opt...] IMAGE COMMAND..." >&2; exit 90; }
shift
while [ "${1#--}" != "$1" ]; do shift; done
shift
exec "$@"
"""
RANK_MARKS = """import os, socket
from trainctl.train.loop.hooks import Hooks

def hooks():
    with open(os.path.join(os.environ["MARKS"], f"rank{os.environ['RANK']}.{os.getpid()}"), "w") as f:
        f.write(f"{socket.gethostname()} {os.environ.get('CONTAINER_MARK', '-')}")
    return Hooks()
"""


def test_a_container_exec_prefix_wraps_every_rank_and_the_bookkeeping(tmp_path):
    marks, hooks = tmp_path / "marks", tmp_path / "hooks"
    marks.mkdir()
    hooks.mkdir()
    (hooks / "rank_marks.py").write_text(RANK_MARKS)
    wrapper = tmp_path / "fake-apptainer"
    wrapper.write_text(WRAPPER)
    wrapper.chmod(0o755)
    run_dir = launch(tmp_path, "wrapped", *SLURM_CPU, "cluster.nodes=2", "cluster.procs_per_node=2", "train.steps=3",
                     "train.micro_batch=2",
                     f"cluster.container.exec={wrapper} exec --nv image.sif", f"+cluster.env.MARKS={marks}",
                     f"+cluster.env.HOOKS={hooks}", "+cluster.env.TRAINCTL_TEST_HOOKS=rank_marks:hooks")
    state = wait_done(run_dir)
    assert state.state == "COMPLETED", failure_report(run_dir)
    # Every worker, on both nodes, ran inside the prefix's environment.
    seen = sorted(p.read_text() for p in marks.glob("rank*"))
    assert sorted({p.name.split(".")[0] for p in marks.glob("rank*")}) == ["rank0", "rank1", "rank2", "rank3"]
    assert {line.split()[1] for line in seen} == {"inside-node1", "inside-node2"}
    assert all(host == mark.removeprefix("inside-") for host, mark in (line.split() for line in seen))
    # The prefix got its own words, then the job's Python: torchrun on each node, and the batch shell's bookkeeping.
    calls = (marks / "wrapper.log").read_text().splitlines()
    torchruns = [c for c in calls if "-m trainctl.train.agent" in c]  # torchrun forking its ranks (cpu)
    assert sorted(c.split()[0] for c in torchruns) == ["node1", "node2"]
    assert all(c.split()[1:5] == ["exec", "--nv", "image.sif", sys.executable] for c in calls)
    assert [c.split()[7] for c in calls if "trainctl.core.rundir" in c] == ["hold", "completed"]
