"""The run directory: complete, never overwriting, never half-written."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from datetime import datetime
from pathlib import Path

import pytest

from trainctl.config.load import load_run_config
from trainctl.config.schema import RunConfig, ShardingConfig, TrainConfig, cluster_configs
from trainctl.launch import code_record, rundir
from trainctl.launch.errors import LaunchError
from trainctl.plan.runplan import build

FILES = {"config.yaml", "plan.json", "launch.sh", "overrides.txt", "code.json", "logs"}


def config(launcher: str = "local") -> RunConfig:
    return RunConfig(
        recipe="tiny_cpu",
        sharding=ShardingConfig(strategy="ddp", dp_replicate=2),
        cluster=cluster_configs()[launcher](procs_per_node=2),
        train=TrainConfig(steps=5, seq_len=32, global_batch=4, micro_batch=1, grad_accum=2),
    )


def create(
    runs_dir: Path, name: str | None = "exp", cfg: RunConfig | None = None, overrides=("optim.lr=1e-4",)
) -> Path:
    cfg = cfg or config()
    return rundir.create(cfg, build(cfg), runs_dir, name, list(overrides), workdir=runs_dir.parent)


def snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(directory)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in directory.rglob("*")
        if p.is_file()
    }


def test_all_files_are_written(tmp_path):
    run_dir = create(tmp_path / "runs")
    assert run_dir == (tmp_path / "runs" / "exp").resolve()
    assert FILES <= {p.name for p in run_dir.iterdir()}
    assert list((run_dir / "logs").iterdir()) == []
    assert (run_dir / "overrides.txt").read_text() == "optim.lr=1e-4\n"
    assert (run_dir / "launch.sh").stat().st_mode & 0o100


def test_config_yaml_round_trips(tmp_path):
    cfg = config()
    run_dir = create(tmp_path / "runs", cfg=cfg)
    assert load_run_config(run_dir) == cfg


def test_plan_json_launches_this_run_dir(tmp_path):
    run_dir = create(tmp_path / "runs")
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["launch_argv"][-3:] == ["-m", "trainctl.train", str(run_dir)]
    assert plan["world_size"] == 2


def test_local_launch_script_is_the_plans_command(tmp_path):
    run_dir = create(tmp_path / "runs")
    plan = json.loads((run_dir / "plan.json").read_text())
    script = (run_dir / "launch.sh").read_text()
    exec_line = next(line for line in script.splitlines() if line.startswith("exec "))
    # The same command, with the run directory found from the script's own location.
    assert exec_line.replace("${RUN_DIR}", str(run_dir)).replace('"', "") == f"exec {plan['launch_command']}".replace(
        "'", ""
    )
    assert f"cd {tmp_path}" in script.splitlines()


def test_slurm_run_gets_an_sbatch_script(tmp_path):
    run_dir = create(tmp_path / "runs", cfg=config("slurm"))
    script = (run_dir / "launch.sh").read_text()
    assert "#SBATCH --nodes=1" in script
    assert f"#SBATCH --output={run_dir}/logs/slurm-%j.out" in script


def test_collision_creates_a_new_dir_and_leaves_the_old_one_alone(tmp_path):
    first = create(tmp_path / "runs", overrides=["a=1"])
    before = snapshot(first)
    second = create(tmp_path / "runs", overrides=["a=2"])
    third = create(tmp_path / "runs", overrides=["a=3"])
    assert (second.name, third.name) == ("exp-1", "exp-2")
    assert snapshot(first) == before
    assert (second / "overrides.txt").read_text() == "a=2\n"


def test_an_existing_foreign_directory_is_never_touched(tmp_path):
    runs = tmp_path / "runs"
    (runs / "exp").mkdir(parents=True)
    (runs / "exp" / "notes.txt").write_text("mine")
    run_dir = create(runs)
    assert run_dir.name == "exp-1"
    assert [p.name for p in (runs / "exp").iterdir()] == ["notes.txt"]


def test_default_name_is_recipe_then_timestamp(tmp_path):
    run_dir = create(tmp_path / "runs", name=None)
    assert re.fullmatch(r"tiny_cpu-\d{8}-\d{6}", run_dir.name)
    assert rundir.default_name(RunConfig(), datetime(2025, 3, 4, 5, 6, 7)) == "tiny-20250304-050607"


def test_a_failure_while_writing_leaves_nothing_behind(tmp_path, monkeypatch):
    runs = tmp_path / "runs"

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(code_record, "record", broken)
    with pytest.raises(LaunchError, match="disk full.*nothing was kept"):
        create(runs)
    assert list(runs.iterdir()) == []


@pytest.mark.parametrize("name", ["a/b", "..", ".hidden"])
def test_names_that_are_not_one_plain_component_are_refused(tmp_path, name):
    cfg = config()
    with pytest.raises(LaunchError):
        rundir.create(cfg, build(cfg), tmp_path / "runs", name, [])
    assert not (tmp_path / "runs").exists()


@pytest.mark.cli
def test_code_json_records_this_checkout(tmp_path):
    run_dir = create(tmp_path / "runs")
    code = json.loads((run_dir / "code.json").read_text())
    assert set(code) == {"git", "sha", "branch", "dirty", "untracked"}
    assert (run_dir / "code.diff").exists() == code["dirty"]


@pytest.mark.cli
def test_outside_a_git_checkout_the_record_says_so(tmp_path):
    assert code_record.record(tmp_path) == code_record.CodeRecord(git=False)


@pytest.mark.cli
@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_dirty_checkout_records_its_diff(tmp_path):
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q", "-b", "work")
    (tmp_path / "model.py").write_text("x = 1\n")
    git("add", "model.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    clean = code_record.record(tmp_path)
    assert (clean.git, clean.branch, clean.dirty, clean.diff) == (True, "work", False, "")
    assert re.fullmatch(r"[0-9a-f]{40}", clean.sha)
    (tmp_path / "model.py").write_text("x = 2\n")
    (tmp_path / "scratch.txt").write_text("untracked")
    dirty = code_record.record(tmp_path)
    assert dirty.dirty and "+x = 2" in dirty.diff
    assert dirty.untracked == ("scratch.txt",)


def test_runs_dir_that_is_a_file_is_one_error_and_leaves_nothing(tmp_path):
    blocker = tmp_path / "runs"
    blocker.write_text("not a directory")
    with pytest.raises(LaunchError, match="runs_dir=.*cannot create"):
        create(blocker)
    with pytest.raises(LaunchError, match="runs_dir=.*cannot create"):
        create(blocker / "deeper")
    assert blocker.read_text() == "not a directory"


def test_a_run_name_too_long_for_the_filesystem_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(LaunchError, match="bytes; use at most"):
        create(tmp_path / "runs", name="x" * 256)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("where", ["workdir", "runs_dir"])
def test_control_characters_in_paths_that_reach_the_script_are_refused(tmp_path, where):
    odd = tmp_path / "a\nrm -rf ~\n"
    odd.mkdir()
    cfg = config()
    runs_dir, workdir = (tmp_path / "runs", odd) if where == "workdir" else (odd / "runs", tmp_path)
    with pytest.raises(LaunchError, match="control characters"):
        rundir.create(cfg, build(cfg), runs_dir, "exp", [], workdir=workdir)
    assert not (tmp_path / "runs").exists() and not (odd / "runs").exists()


def test_disk_full_while_writing_is_one_error_and_leaves_nothing(tmp_path, monkeypatch):
    import errno

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rundir, "write_script", full)
    with pytest.raises(LaunchError, match="No space left on device.*nothing was kept"):
        create(tmp_path / "runs")
    assert list((tmp_path / "runs").iterdir()) == []


@pytest.mark.cli
def test_the_script_finds_its_run_directory_wherever_the_run_is_copied(tmp_path):
    run_dir = create(tmp_path / "runs")
    copy = tmp_path / "elsewhere" / "copy"
    shutil.copytree(run_dir, copy)
    script = (copy / "launch.sh").read_text()
    # Run only the script's first lines (up to the lock), then print where it thinks it is.
    head = script.split("\ncd ", 1)[0] + '\necho "$RUN_DIR"\n'
    (copy / "head.sh").write_text(head)
    done = subprocess.run(["bash", str(copy / "head.sh")], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(copy.resolve())
    assert str(run_dir) not in script
