"""squeue/sacct/scancel answers (stubbed): an unreachable controller is said so, quickly, not taken for a forgotten
job."""

from __future__ import annotations

import time

import pytest

from tests.helpers import write_exe
from trainctl.launch.backends.slurm import jobs as slurm_jobs
from trainctl.launch.errors import LaunchError

UNREACHABLE = "slurm_load_jobs error: Unable to contact slurm controller (connect failure)"


def test_unknown_jobs_are_simply_not_known(slurm_bin):
    assert slurm_jobs.job_infos(["7"]) == {}
    assert slurm_jobs.query_jobs(["7"]) == ({}, "")


@pytest.mark.parametrize(
    "stderr",
    [
        UNREACHABLE,
        "squeue: error: slurm_receive_msg: Socket timed out on send/recv operation",
        "squeue: error: Zero Bytes were transmitted or received",
    ],
)
def test_an_unreachable_controller_is_reported_as_such(slurm_bin, stderr):
    write_exe(slurm_bin / "squeue", f'echo "{stderr}" >&2; exit 1\n')
    with pytest.raises(slurm_jobs.SlurmUnavailable, match="^Slurm controller unreachable: squeue: "):
        slurm_jobs.job_infos(["7"])
    infos, reason = slurm_jobs.query_jobs(["7"])
    assert infos == {} and reason.startswith("Slurm controller unreachable") and "no longer knows" not in reason


def test_a_hanging_controller_is_given_up_on_after_the_short_timeout(slurm_bin, monkeypatch):
    write_exe(slurm_bin / "squeue", "sleep 30\n")
    monkeypatch.setattr(slurm_jobs, "QUERY_TIMEOUT_S", 0.5)
    start = time.monotonic()
    infos, reason = slurm_jobs.query_jobs(["7"])
    assert time.monotonic() - start < 5
    assert infos == {} and reason == "Slurm controller unreachable: squeue did not answer within 0.5 s"


def test_the_default_timeout_is_short():
    assert slurm_jobs.QUERY_TIMEOUT_S <= 10  # squeue's own retries take ~18 s; `trainctl runs` must not wait that long


def test_an_unreachable_accounting_database_is_not_a_forgotten_job(slurm_bin):
    write_exe(slurm_bin / "sacct",
              'echo "sacct: error: Problem talking to the database: Connection refused" >&2; exit 1\n')
    with pytest.raises(slurm_jobs.SlurmUnavailable, match="unreachable: sacct"):
        slurm_jobs.job_infos(["7"])


def test_another_squeue_failure_is_not_a_forgotten_job_either(slurm_bin):
    write_exe(slurm_bin / "squeue", 'echo "squeue: error: Invalid user for SlurmUser" >&2; exit 1\n')
    assert slurm_jobs.query_jobs(["7"])[1] == "Slurm query failed: squeue: squeue: error: Invalid user for SlurmUser"


def test_known_jobs_still_come_back(slurm_bin):
    write_exe(slurm_bin / "squeue", 'echo "7|RUNNING|None|node1"\n')
    assert slurm_jobs.query_jobs(["7"]) == ({"7": slurm_jobs.JobInfo("7", "RUNNING", "", "node1")}, "")


def test_scancel_against_an_unreachable_controller_is_one_launch_error(slurm_bin):
    write_exe(slurm_bin / "scancel", f'echo "scancel: error: {UNREACHABLE}" >&2; exit 1\n')
    with pytest.raises(LaunchError, match="^Slurm controller unreachable: scancel: "):
        slurm_jobs.cancel_job("7")
