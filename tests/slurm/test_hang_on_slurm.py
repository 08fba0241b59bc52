"""A hung rank on the local Slurm cluster: its watchdog dumps the stacks, srun fails, the batch shell names the node
that hung and requeues the job, which resumes from its newest checkpoint; a node that hangs first again and again is
excluded from the job (by a small job that waits for it to be pending, held, and releases it).

cluster.max_restarts=0, so torchrun gives up at once and the Slurm requeue is the only way on. The faults reach the
job's workers through the environment: sbatch exports the submitter's (TRAINCTL_FAULTS, TRAINCTL_TEST_HOOKS).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from test_slurm_cluster import (
    FAST,
    JOB_TIMEOUT_S,
    SLURM_CPU,
    _requeued_and_released,
    trainctl,
    wait_done,
    wait_on_slurm,
)

from tests.faults.worker_faults import fault_env
from tests.helpers import wait_for
from trainctl.core import hangs, rundir

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]

STEPS, EVERY, HANG_STEP = 8, 2, 5
TIMEOUT_S = 15.0  # far above a tiny step on 2 busy cores, short for the test
HANG = ["train.eval_every=0", f"train.steps={STEPS}", f"checkpoint.every={EVERY}", f"train.hang_timeout_s={TIMEOUT_S}"]


def launch_faulty(cwd: Path, name: str, faults: dict, *overrides: str) -> tuple[Path, str]:
    done = trainctl("launch", *FAST, *SLURM_CPU, *HANG, *overrides, "--name", name, cwd=cwd, timeout=JOB_TIMEOUT_S,
                    **fault_env(**faults))
    assert done.returncode == 0, f"launch failed:\n{done.stdout}\n{done.stderr}"
    run_dir = cwd / "runs" / name
    return run_dir, json.loads((run_dir / rundir.LAUNCH).read_text())["job_id"]


def attempts(run_dir: Path) -> list[dict]:
    path = run_dir / rundir.ATTEMPTS  # written by the job once it starts
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def batch_log(run_dir: Path, job_id: str) -> str:
    return (run_dir / "logs" / f"slurm-{job_id}.out").read_text()


def released_until(job_id: str, run_dir: Path, attempt: int) -> bool:
    """Release each requeue at once (slurmctld holds it ~120 s) until `attempt` has started; True then."""
    _requeued_and_released(job_id, run_dir)
    return any(a["event"] == "start" and a["attempt"] == attempt for a in attempts(run_dir))


def test_a_hung_rank_requeues_the_job_which_resumes_and_completes(tmp_path):
    run_dir, job_id = launch_faulty(tmp_path, "hung", {"hang_after_step": HANG_STEP},
                                    "cluster.nodes=2", "cluster.procs_per_node=1")
    wait_on_slurm(lambda: (run_dir / rundir.RESULT).is_file() or released_until(job_id, run_dir, 1) and None,
                  "the requeued job to finish", run_dir, timeout=3 * JOB_TIMEOUT_S)
    assert wait_done(run_dir).state == "COMPLETED"  # the batch shell records the attempt's end after result.json
    result = json.loads((run_dir / rundir.RESULT).read_text())
    assert result["steps"] == STEPS and result["resumed_from_step"] == HANG_STEP - HANG_STEP % EVERY, result

    # The stuck rank's stack file names the frame it hung in; the node it ran on is the one the job names.
    (stuck,) = [h for h in hangs.hangs(run_dir) if h.rank == 1]
    assert stuck.attempt.slurm_restart == 0 and stuck.attempt.run_id == job_id and stuck.timeout_s == TIMEOUT_S
    assert "Timeout (" in stuck.path.read_text() and "hang_forever" in stuck.path.read_text()
    assert stuck.host in {"node1", "node2"}
    log = batch_log(run_dir, job_id)
    assert f"trainctl: job {job_id} attempt 0 hung on node(s) {stuck.host} " in log, log
    assert "excluded" not in log  # one hang is not a pattern

    # The attempt records count the hang: attempt 0 failed, attempt 1 resumed and ended well.
    records = [(a["event"], a["attempt"], a["exit_code"]) for a in attempts(run_dir)]
    assert records[0] == ("start", 0, None) and records[1][:2] == ("end", 0) and records[1][2] != 0, records
    assert records[2:] == [("start", 1, None), ("end", 1, 0)], records
    resumes = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumes if r["kind"] == "resume"] == [HANG_STEP - HANG_STEP % EVERY]
    assert result["requeues"] == 1 and result["requeue_reasons"] == [
        {"attempt": 0, "reason": "hang", "hosts": [stuck.host]}], result


def job_fields(job_id: str) -> dict[str, str]:
    shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    return dict(word.split("=", 1) for word in shown.split() if "=" in word)


def test_a_node_that_hangs_twice_is_excluded_and_the_job_completes_elsewhere(tmp_path):
    # One node, two workers: Slurm places the job on node1 (both idle, the first one wins) until node1 is excluded.
    run_dir, job_id = launch_faulty(tmp_path, "hangs-on-node1", {"hang_on_host": ["node1", 3]},
                                    "cluster.nodes=1", "cluster.procs_per_node=2")
    # Each requeue is released from Slurm's ~120 s begin-time delay at once; the second one (requeued held) is
    # released by the exclusion job, not by the test.
    wait_on_slurm(lambda: (run_dir / rundir.RESULT).is_file() or released_until(job_id, run_dir, 99) and None,
                  "the job to finish on another node", run_dir, timeout=4 * JOB_TIMEOUT_S)
    assert wait_done(run_dir).state == "COMPLETED"
    assert [a["nodes"] for a in attempts(run_dir) if a["event"] == "start"] == ["node1", "node1", "node2"]
    log = batch_log(run_dir, job_id)
    assert log.count("hung on node(s) node1 ") == 2 and "node(s) node1 hung first in repeated attempts" in log, log
    (fixer,) = re.findall(r"requeued held; job (\d+) excludes them", log)
    assert job_fields(job_id).get("ExcNodeList") == "node1"
    assert wait_done_job(fixer) == "COMPLETED"
    result = json.loads((run_dir / rundir.RESULT).read_text())
    assert result["steps"] == STEPS and result["requeues"] == 2
    assert [r["hosts"] for r in result["requeue_reasons"]] == [["node1"], ["node1"]], result


def wait_done_job(job_id: str) -> str:
    """The final state of a job (sacct may be absent: squeue while listed, then scontrol's record)."""
    def ended():
        state = job_fields(job_id).get("JobState")
        return state if state in {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"} else None

    return wait_for(ended, f"job {job_id} to end", JOB_TIMEOUT_S)
