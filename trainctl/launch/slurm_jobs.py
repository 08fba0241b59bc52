"""Asking Slurm about jobs, and cancelling them: squeue, sacct, scancel.

squeue knows pending and running jobs, and finished ones for the controller's
MinJobAge (5 minutes by default); sacct knows them for longer but only where
accounting is configured. Whatever neither knows, the caller decides from the run
directory (see `runs.py`).
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

from trainctl.launch.errors import LaunchError

QUERY_TIMEOUT_S = 30
# States in which the job may still run (or run again); everything else is final.
ACTIVE_STATES = frozenset(
    {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED"}
)


@dataclass(frozen=True)
class JobInfo:
    """What Slurm says about one job."""

    job_id: str
    state: str  # Slurm's name: PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT, ...
    reason: str = ""  # why it waits, or why it ended
    nodes: str = ""
    exit_code: str = ""  # sacct's "code:signal", when sacct answered

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES


def _run(argv: list[str]) -> subprocess.CompletedProcess | None:
    """Run a Slurm client; None when it is not installed or does not answer."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=QUERY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None


def query_squeue(job_ids: list[str]) -> dict[str, JobInfo]:
    """Jobs the controller still holds, finished ones included (`--states=all`)."""
    if not job_ids:
        return {}
    done = _run(["squeue", "--noheader", "--states=all", f"--jobs={','.join(job_ids)}", "--format=%i|%T|%r|%N"])
    # A list of only unknown ids fails with "Invalid job id specified"; that just means "not known".
    if done is None or done.returncode != 0:
        return {}
    infos = {}
    for line in done.stdout.splitlines():
        job_id, state, reason, nodes = (line.split("|") + ["", "", "", ""])[:4]
        infos[job_id.strip()] = JobInfo(job_id.strip(), state.strip(), "" if reason == "None" else reason.strip(), nodes.strip())
    return infos


def query_sacct(job_ids: list[str]) -> dict[str, JobInfo]:
    """Jobs from the accounting database; empty where accounting is disabled."""
    if not job_ids:
        return {}
    done = _run(["sacct", "--noheader", "--parsable2", "--allocations", f"--jobs={','.join(job_ids)}", "--format=JobID,State,NodeList,ExitCode"])
    if done is None or done.returncode != 0:
        return {}
    infos = {}
    for line in done.stdout.splitlines():
        job_id, state, nodes, exit_code = (line.split("|") + ["", "", "", ""])[:4]
        # "CANCELLED by 0" -> CANCELLED
        infos[job_id] = JobInfo(job_id, state.split()[0] if state else "UNKNOWN", "", nodes, exit_code)
    return infos


def job_infos(job_ids: list[str]) -> dict[str, JobInfo]:
    """squeue first (current), then sacct for the jobs squeue has forgotten."""
    infos = query_squeue(job_ids)
    missing = [j for j in job_ids if j not in infos]
    return {**infos, **query_sacct(missing)}


def slurm_available() -> bool:
    return shutil.which("squeue") is not None


def cancel_job(job_id: str) -> None:
    """scancel the job; its stderr becomes the error message when Slurm refuses."""
    done = _run(["scancel", job_id])
    if done is None:
        raise LaunchError(f"cannot cancel Slurm job {job_id}: scancel was not found on PATH or did not answer; run this on a Slurm login node")
    if done.returncode != 0:
        reason = " ".join(done.stderr.split()) or f"exit code {done.returncode}"
        raise LaunchError(f"scancel {job_id} failed: {reason}")
