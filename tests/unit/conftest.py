"""Fixtures shared by the unit tests."""

from __future__ import annotations

import os

import pytest

from tests.helpers import write_exe
from trainctl.launch import code_record

REAL_CODE_RECORD = code_record.record


@pytest.fixture(scope="session", autouse=True)
def no_git_in_process():
    """Writing a run directory records the checkout by running git (a subprocess): in-process tests, and
    module fixtures that write a run, get a fixed record ("not a git checkout")."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(code_record, "record", lambda source=None: code_record.CodeRecord(git=False))
        yield


@pytest.fixture(autouse=True)
def real_git_for_cli_tests(request, monkeypatch):
    """Tests marked `cli` (test_rundir's code.json tests) run the real git record."""
    if request.node.get_closest_marker("cli") is not None:
        monkeypatch.setattr(code_record, "record", REAL_CODE_RECORD)


@pytest.fixture(scope="session", autouse=True)
def matplotlib_font_cache(request):
    """matplotlib builds its font cache on first use by running `fc-list`: a subprocess, which a unit test may
    not start. On a fresh machine (CI) the plotting tests would fail for it, so the cache is built once here,
    before any test's process guard is in place, and only when plotting tests are selected."""
    if any(item.path.name == "test_plot.py" for item in request.session.items):
        try:
            import matplotlib.font_manager  # noqa: F401 (imported for its cache-building side effect)
        except ImportError:
            pass
    yield


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
