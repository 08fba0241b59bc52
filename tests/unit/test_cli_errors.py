"""User errors through the console entry: one literal line each (no rich markup eaten), exit code 2."""

from __future__ import annotations

import pytest

from tests.helpers import cli_in_process


def answer(monkeypatch, capsys, *argv: str) -> tuple[int, str]:
    code, _, err = cli_in_process(monkeypatch, capsys, *argv)
    return code, err


def test_brackets_in_an_error_line_are_printed_literally(monkeypatch, capsys):
    code, err = answer(monkeypatch, capsys, "plan", "hydra.searchpath=[file:///tmp]")
    assert code == 2
    assert "hydra.searchpath=[file:///tmp]" in err  # rich would read [file:///tmp] as markup and drop it


def test_an_absurd_layer_count_fails_at_once_instead_of_hanging_the_plan(monkeypatch, capsys):
    code, err = answer(monkeypatch, capsys, "plan", "recipe=tiny_cpu", "model.n_layers=1099511627776")
    assert code == 2 and "model.n_layers=1099511627776" in err and len(err.strip().splitlines()) == 1


@pytest.mark.cli
def test_a_refused_sbatch_leaves_no_run_directory(tmp_path, monkeypatch, capsys):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text("#!/usr/bin/env bash\n"
                      "echo 'sbatch: error: Batch job submission failed: Invalid account' >&2\nexit 1\n")
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.chdir(tmp_path)
    code, err = answer(monkeypatch, capsys, "launch", "recipe=tiny_cpu", "cluster=slurm", "--name", "refused")
    assert code == 2 and "Invalid account" in err and "Traceback" not in err
    assert list((tmp_path / "runs").iterdir()) == []  # nothing for `runs` to call "written by --dry-run"
