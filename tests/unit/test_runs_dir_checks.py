"""runs_dir as users get it wrong (issue 35): a file where the folder of runs should be, and a path with spaces,
which only Slurm's #SBATCH lines cannot hold (a local run takes it; Slurm refuses it before writing anything)."""

from __future__ import annotations

import pytest

from tests.helpers import cli_in_process
from trainctl import api
from trainctl.core.errors import UserError

TINY = ["recipe=tiny_cpu"]


def test_a_runs_dir_that_is_a_file_is_one_line_not_an_empty_table(tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("")
    with pytest.raises(UserError, match=r"^runs_dir \S*afile: a file, not a folder of runs; point --runs-dir"):
        api.runs(runs_dir=tmp_path / "afile")
    monkeypatch.setenv("TRAINCTL_RUNS_DIR", str(tmp_path / "afile"))
    with pytest.raises(UserError, match="a file, not a folder of runs"):
        api.runs()
    assert api.runs(runs_dir=tmp_path / "not-yet") == []  # no run launched yet: an empty table is the truth


def test_the_cli_says_it_in_one_line_with_exit_2(tmp_path, monkeypatch, capsys):
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("TRAINCTL_RUNS_DIR", str(tmp_path / "afile"))
    code, out, err = cli_in_process(monkeypatch, capsys, "runs")
    assert (code, out) == (2, "")
    assert [line for line in err.splitlines() if line.strip()] == [
        f"error: runs_dir {tmp_path / 'afile'}: a file, not a folder of runs; point --runs-dir (or "
        "$TRAINCTL_RUNS_DIR, runs_dir=) at the folder the runs were launched into"]


def test_a_local_run_takes_a_runs_dir_with_spaces(tmp_path):
    prepared = api.prepare_launch([*TINY, f"runs_dir={tmp_path / 'my runs'}"], dry_run=True, name="r")
    assert prepared.run_dir == (tmp_path / "my runs" / "r") and (prepared.run_dir / "launch.sh").is_file()


@pytest.mark.parametrize("where", ["given", "relative in a spaced cwd"])
def test_slurm_refuses_a_spaced_run_directory_before_writing_anything(where, tmp_path, monkeypatch):
    spaced = tmp_path / "my runs"
    spaced.mkdir()
    if where == "given":
        runs_dir = str(spaced / "r")
    else:
        monkeypatch.chdir(spaced)
        runs_dir = "runs"
    with pytest.raises(UserError) as err:
        api.prepare_launch([*TINY, "cluster=slurm", f"runs_dir={runs_dir}"], dry_run=True)
    (line,) = err.value.problems
    assert line.startswith(f"runs_dir={runs_dir!r}") and "cannot hold whitespace or '%'" in line
    assert "(cluster=local takes any path)" in line
    assert list(spaced.iterdir()) == []


def test_slurm_refuses_a_percent_in_the_run_name(tmp_path):
    with pytest.raises(UserError, match=r"name='a%jb': Slurm reads the run directory from an #SBATCH line"):
        api.prepare_launch([*TINY, "cluster=slurm", f"runs_dir={tmp_path}", "name=a%jb"], dry_run=True)
    with pytest.raises(UserError, match=r"'a%jb' cannot go into an #SBATCH line"):
        api.prepare_launch([*TINY, "cluster=slurm", f"runs_dir={tmp_path}"], dry_run=True, name="a%jb")
    assert list(tmp_path.iterdir()) == []
