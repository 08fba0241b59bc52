"""A Slurm job whose workers hung past torchrun's restarts: the batch shell names the node, requeues the job, and
excludes a node that hung first in repeated attempts (the script run with stub srun/scontrol)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import wait_for, write_exe
from tests.unit.test_hang_watchdog import write_hang
from tests.unit.test_sbatch import SLURM_ENV, slurm_config, stub_bin
from trainctl.core import hangs
from trainctl.launch.backends.slurm import script as slurm

JOB = SLURM_ENV["SLURM_JOB_ID"]
T0 = 1_800_000_000.0


def hung_on(run_dir: Path, host: str, restart: int, at: float, run_id: str = JOB) -> None:
    """Rank 1 on `host` hung first in torchrun attempt `restart` of this job; rank 0 on node017 fired after it."""
    write_hang(run_dir, 1, restart=restart, run_id=run_id, at=at, host=host)
    write_hang(run_dir, 0, restart=restart, run_id=run_id, at=at + 0.5, host="node017")


def run_hung_job(tmp_path: Path, prepare, wait_s: float = 0, sbatch: str = "exit 1\n") -> tuple[list[str], str]:
    """The script with srun failing; (what the stub scontrol was asked to do, the script's stderr)."""
    run_dir = tmp_path / "run-h"
    (run_dir / "logs").mkdir(parents=True)
    prepare(run_dir)
    bin_dir = stub_bin(tmp_path)
    write_exe(bin_dir / "srun", "exit 1\n")
    write_exe(bin_dir / "sbatch", sbatch)
    write_exe(bin_dir / "scontrol", f'case "$1" in requeue|requeuehold|update) echo "$*" >> {tmp_path}/asked; '
                                    'exit 0;; esac\necho node017\n')
    script = run_dir / "launch.sh"
    script.write_text(slurm.render_sbatch(slurm_config(), run_dir, workdir=tmp_path))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", **SLURM_ENV, "TRAINCTL_REQUEUE_WAIT_S": str(wait_s)}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    asked = tmp_path / "asked"
    return (asked.read_text().splitlines() if asked.exists() else []), done.stderr


@pytest.mark.cli
def test_a_hung_job_is_requeued_naming_the_node_that_hung_first(tmp_path):
    asked, stderr = run_hung_job(tmp_path, lambda run_dir: hung_on(run_dir, "node018", 0, T0))
    assert asked == [f"requeue {JOB}"], stderr
    assert "hung on node(s) node018" in stderr, stderr


@pytest.mark.cli
def test_after_the_requeue_the_shell_waits_for_slurm_to_end_it_and_records_the_end_once(tmp_path):
    # Exiting at once with the failed status races the requeue's kill; on Slurm 22.05 the job then ends FAILED.
    started = time.monotonic()
    asked, stderr = run_hung_job(tmp_path, lambda run_dir: hung_on(run_dir, "node018", 0, T0), wait_s=2)
    assert time.monotonic() - started >= 2, stderr
    assert asked == [f"requeue {JOB}"], stderr
    ends = [line for line in (tmp_path / "run-h" / slurm.ATTEMPTS_FILE).read_text().splitlines() if '"end"' in line]
    assert len(ends) == 1 and '"exit_code": 1' in ends[0], ends


@pytest.mark.cli
def test_the_shell_killed_by_the_requeue_leaves_the_run_unlocked(tmp_path):
    # Slurm's requeue kills the waiting shell; a child it left behind holding the run's lock (a `sleep`) made the
    # requeued attempt refuse the run as "being trained".
    run_dir = tmp_path / "run-h"
    (run_dir / "logs").mkdir(parents=True)
    hung_on(run_dir, "node018", 0, T0)
    bin_dir = stub_bin(tmp_path)
    write_exe(bin_dir / "srun", "exit 1\n")
    write_exe(bin_dir / "scontrol", f'case "$1" in requeue) echo "$*" >> {tmp_path}/asked; exit 0;; esac\n'
                                    'echo node017\n')
    script = run_dir / "launch.sh"
    script.write_text(slurm.render_sbatch(slurm_config(), run_dir, workdir=tmp_path))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", **SLURM_ENV, "TRAINCTL_REQUEUE_WAIT_S": "60"}
    shell = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: (tmp_path / "asked").exists(), "the requeue", 30)
        time.sleep(0.5)  # into the wait
        assert shell.poll() is None, "the shell did not wait for the requeue's kill"
        shell.terminate()
        shell.wait(10)
    finally:
        shell.kill()
    lock = run_dir / "trainer.lock"
    assert subprocess.run(["flock", "-n", str(lock), "true"], timeout=10).returncode == 0, "the run is still locked"


def hung_twice_on_node018(run_dir: Path) -> None:
    hung_on(run_dir, "node018", 0, T0)
    hung_on(run_dir, "node018", 1, T0 + 100)
    hung_on(run_dir, "node099", 0, T0, run_id="another-job")  # another job's hang does not count


@pytest.mark.cli
def test_a_node_that_hung_first_twice_is_excluded_by_a_job_that_releases_the_held_one(tmp_path):
    # Slurm excludes nodes only from a pending job: this one is requeued held, and a small job submitted first waits
    # for it to be pending, excludes the node and releases it.
    sbatch = f'printf "%s\\n" "$@" > {tmp_path}/sbatch-args\necho 4242\n'
    asked, stderr = run_hung_job(tmp_path, hung_twice_on_node018, sbatch=sbatch)
    assert asked == [f"requeuehold {JOB}"], stderr
    assert "node(s) node018 hung first in repeated attempts" in stderr and "job 4242 excludes them" in stderr, stderr
    args = (tmp_path / "sbatch-args").read_text().splitlines()
    wrapped = args[args.index("--wrap") + 1]
    waits = f'for i in $(seq {slurm.EXCLUSION_WAIT_S}); do [ "$(squeue -h -j {JOB} -o %T)" = PENDING ]'
    assert wrapped.startswith(waits), wrapped
    assert wrapped.endswith(f"scontrol update JobId={JOB} ExcNodeList=node018 && scontrol release {JOB}"), wrapped
    assert f"--output={tmp_path}/run-h/logs/slurm-exclude-%j.out" in args
    # The wrapped script is valid shell (bash -n parses without running).
    assert subprocess.run(["bash", "-n", "-c", wrapped], timeout=10).returncode == 0


@pytest.mark.cli
def test_where_the_exclusion_job_is_refused_the_log_gives_the_command(tmp_path):
    asked, stderr = run_hung_job(tmp_path, hung_twice_on_node018, sbatch="echo 'sbatch: error: denied' >&2; exit 1\n")
    assert asked == [f"requeuehold {JOB}"], stderr
    assert f"release it with: scontrol update JobId={JOB} ExcNodeList=node018 && scontrol release {JOB}" in stderr


@pytest.mark.cli
def test_a_failure_without_a_hang_is_not_requeued(tmp_path):
    asked, stderr = run_hung_job(tmp_path, lambda run_dir: hung_on(run_dir, "node018", 0, T0, run_id="another-job"))
    assert asked == [], stderr
    assert "hung on" not in stderr


def test_the_shell_s_questions_answer_from_the_files(tmp_path, capsys):
    hung_on(tmp_path, "node018", 0, T0)
    assert hangs.main(["hung", str(tmp_path), JOB, "0"]) == 0 and capsys.readouterr().out.strip() == "node018"
    assert hangs.main(["hung", str(tmp_path), JOB, "1"]) == 1  # another Slurm attempt: nothing hung there
    assert hangs.main(["repeated", str(tmp_path), JOB]) == 1
    assert hangs.main(["nonsense"]) == 2
