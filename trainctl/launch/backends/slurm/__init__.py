"""The Slurm backend (`cluster=slurm`): an sbatch script per run (a job array per sweep and per tune), submitted
and watched through Slurm's clients. The script is script.py's (its `cluster.setup` checked by setup_check.py),
its submission submit.py's, the queries and scancel jobs.py's; its typed config is config/slurm.py."""

from __future__ import annotations

import math
import shlex
import shutil
from pathlib import Path

from trainctl.config.schema import ClusterConfig, RunConfig
from trainctl.core import rundir
from trainctl.launch.backends import register
from trainctl.launch.backends.base import Backend, Launched, State, StateTuple
from trainctl.launch.backends.slurm import job_python
from trainctl.launch.backends.slurm import jobs as slurm_jobs
from trainctl.launch.backends.slurm import script as slurm
from trainctl.launch.backends.slurm import submit as slurm_submit
from trainctl.launch.errors import LaunchError


def attempt_records(run_dir: Path, job_id: str) -> list[dict]:
    return [r for r in rundir.read_jsonl(run_dir / slurm.ATTEMPTS_FILE) if str(r.get("job_id")) == job_id]


def state_from_records(run_dir: Path, job_id: str, why: str) -> tuple[str, bool, str]:
    """A Slurm run's final state from what the job wrote, for jobs Slurm no longer reports."""
    records = attempt_records(run_dir, job_id)
    if records and records[-1].get("event") == "end":
        code = records[-1].get("exit_code")
        return ("COMPLETED", False, "") if code == 0 else ("FAILED", False, f"exit code {code}")
    if records:
        attempt = records[-1].get("attempt")
        return "UNKNOWN", False, f"{why}; attempt {attempt} started but never recorded its end (cancelled or killed)"
    if rundir.result(run_dir) is not None:
        return "COMPLETED", False, ""
    return "UNKNOWN", False, why


def slurm_state(run_dir: Path, job_id: str, info: slurm_jobs.JobInfo | None, unreachable: str = "") -> State:
    if info is not None:
        detail = info.reason if info.state == "PENDING" else ", ".join(x for x in (info.nodes, info.reason) if x)
        if info.exit_code and info.exit_code != "0:0":
            detail = ", ".join(x for x in (detail, f"exit {info.exit_code}") if x)
        return State(info.state, info.active, detail)
    if unreachable:
        # Nothing is known: the job may well be running. The run's own records can still tell an ended attempt.
        state, active, detail = state_from_records(run_dir, job_id, unreachable)
        if state != "UNKNOWN":
            return State(state, active, detail)
        return State("UNKNOWN", False, unreachable, maybe_active=unreachable.startswith(slurm_jobs.UNREACHABLE))
    why = f"Slurm no longer knows job {job_id}" if slurm_jobs.slurm_available() else "squeue not found on PATH"
    return State(*state_from_records(run_dir, job_id, why))


def slurm_log_path(run_dir: Path, job_id: str) -> Path:
    """A Slurm job's newest attempt (the workers' output), else the batch script's own output."""
    attempts = [int(r.get("attempt", 0)) for r in attempt_records(run_dir, job_id)]
    attempt_log = run_dir / "logs" / slurm.attempt_log_name(job_id, max(attempts, default=0))
    batch_log = run_dir / "logs" / f"slurm-{job_id}.out"
    # Before srun starts only the batch log exists (and holds any error of the script's own lines).
    return attempt_log if attempt_log.exists() or not batch_log.exists() else batch_log


def time_limit(timeout_s: float) -> str:
    """sbatch --time in minutes (Slurm's M format), at least one."""
    return str(max(1, math.ceil(timeout_s / 60)))


class SlurmBackend(Backend):
    name = "slurm"

    def preflight(self, cfg: RunConfig, *, dry_run: bool, machine=None) -> list[str]:
        return slurm.directive_path_problems(cfg) + slurm.setup_problems(cfg) + job_python.local_problems(cfg.cluster)

    def submit_problems(self, cfg: RunConfig) -> list[str]:
        if shutil.which("sbatch") is None:
            return ["cluster.launcher=slurm: sbatch was not found on PATH; "
                    "run on a Slurm login node, use cluster=local, or pass --dry-run"]
        return []

    def render(self, cfg: RunConfig, run_dir: Path, workdir: Path) -> str:
        return slurm.render_sbatch(cfg, run_dir, workdir)

    def argv(self, cluster: ClusterConfig, run_dir: Path) -> list[str]:
        return slurm.slurm_argv(cluster, run_dir)

    def start_command(self, script: Path) -> list[str]:
        return ["sbatch", str(script)]

    def start(self, run_dir: Path, cfg: RunConfig, *, new: bool, held=None, out=None) -> Launched:
        try:
            job_id = slurm_submit.submit(run_dir)
        except LaunchError:
            if new:  # nothing was queued: a run directory nobody can start is not kept
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
        follow = shlex.join(["trainctl", "logs", str(run_dir), "--follow"])
        return Launched(job_id=job_id, message=f"submitted Slurm job {job_id}; follow it with: {follow}")

    def sweep_problems(self, cfgs: list[RunConfig]) -> list[str]:
        return slurm_submit.array_problems(cfgs)

    def write_sweep(self, cfg: RunConfig, name: str, folder: Path, run_dirs: list[Path]) -> Path | None:
        return slurm_submit.write_array(cfg, name, folder, run_dirs)

    def start_sweep(self, cfg: RunConfig, name: str, folder: Path, run_dirs: list[Path]) -> Launched | None:
        array_id = slurm_submit.submit_array(cfg, name, folder, run_dirs)
        return Launched(job_id=array_id, message=f"submitted {self.sweep_label(array_id)} ({len(run_dirs)} tasks); "
                        f"watch it with: trainctl runs --sweep {name}")

    def sweep_label(self, job_id: str) -> str:
        return f"Slurm job array {job_id}"

    queues_probes = True

    def probe_overrides(self, timeout_s: float) -> list[str]:
        return [f"cluster.time_limit={time_limit(timeout_s)}"]  # a hung probe ends with its job

    def states(self, records: dict[Path, dict]) -> dict[Path, StateTuple]:
        """One squeue (and at most one sacct) call for all the runs."""
        queried = [str(r["job_id"]) for r in records.values() if isinstance(r.get("job_id"), str | int)]
        infos, unreachable = slurm_jobs.query_jobs(queried) if queried else ({}, "")
        job_ids = {d: str(r.get("job_id", "")) for d, r in records.items()}
        return {d: slurm_state(d, job_ids[d], infos.get(job_ids[d]), unreachable) for d in records}

    def log_path(self, run_dir: Path, record: dict) -> Path:
        return slurm_log_path(run_dir, str(record.get("job_id")))

    def job_label(self, job_id: str) -> str:
        return f"Slurm job {job_id}"

    def cancel(self, run_dir: Path, job_id: str) -> None:
        slurm_jobs.cancel_job(job_id)

    def holder_job(self, holder: dict) -> str:
        return rundir.as_str(holder.get("slurm_job_id"))  # what the trainer lock records inside a Slurm job


register(SlurmBackend())
