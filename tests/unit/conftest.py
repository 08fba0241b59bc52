"""Fixtures shared by the unit tests."""

from __future__ import annotations

import os

import pytest

from tests.helpers import write_exe


@pytest.fixture
def slurm_bin(tmp_path, monkeypatch):
    """squeue/sacct that know no job and have no accounting (a fresh cluster); scancel records its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write_exe(bin_dir / "squeue", 'echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1\n')
    write_exe(bin_dir / "sacct", 'echo "Slurm accounting storage is disabled" >&2; exit 1\n')
    write_exe(bin_dir / "scancel", f'echo "$@" > {tmp_path}/scancel_args\n')
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return bin_dir
