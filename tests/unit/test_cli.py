"""Every CLI command, in a fresh interpreter as a user runs it, including bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import run_cli
from trainctl.config.compose import list_options, project_root

pytestmark = pytest.mark.cli


def trainctl(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The CLI in a fresh interpreter; `.probe` says its exit code and whether torch or wandb got imported."""
    return run_cli(*args, cwd=cwd, timeout=120)


@pytest.fixture
def workdir(tmp_path):
    return tmp_path


LIGHT_COMMANDS = [
    ["--help"],
    ["-h"],
    ["--version"],
    ["plan", "-h"],
    ["recipes"],
    ["config", "groups"],
    ["config", "show", "recipe=llama7b_fsdp", "optim.lr=1e-4"],
    ["plan", "recipe=llama7b_fsdp", "cluster.nodes=2"],
    ["plan", "recipe=llama70b_3d", "--json"],
    ["launch", "recipe=llama7b_fsdp", "data=synthetic", "--dry-run"],
    ["launch", "--help"],
]


@pytest.mark.parametrize("args", LIGHT_COMMANDS, ids=lambda a: " ".join(a))
def test_login_node_commands_succeed_without_torch(args, workdir):
    proc = trainctl(*args, cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    assert proc.probe == {"code": 0, "heavy": []}, "the launcher side must not import torch or wandb"
    assert proc.stdout.strip()


def test_recipes_lists_every_recipe_one_line_each(workdir):
    out = trainctl("recipes", cwd=workdir).stdout
    for name in list_options("recipe"):
        assert sum(line.split()[0] == name for line in out.splitlines() if line.strip()) == 1


def test_config_groups_lists_every_option(workdir):
    out = trainctl("config", "groups", cwd=workdir).stdout
    for group in ("model", "precision", "sharding", "schedule", "cluster", "data", "optim"):
        assert group in out
        for option in list_options(group):
            assert option in out


def test_config_show_applies_overrides(workdir):
    out = trainctl("config", "show", "recipe=llama7b_fsdp", "optim.lr=1e-4", "cluster.nodes=2", cwd=workdir).stdout
    import yaml  # PyYAML ships with omegaconf

    cfg = yaml.safe_load(out)
    assert cfg["optim"]["lr"] == 1e-4
    assert cfg["model"]["name"] == "llama2_7b"
    assert cfg["sharding"]["dp_shard"] == 16  # resolved: 2 nodes x 8 GPUs
    assert cfg["train"]["grad_accum"] == 8  # 256 / (2 x 16)


def test_plan_json_matches_the_model(workdir):
    proc = trainctl("plan", "recipe=llama7b_fsdp", "cluster.nodes=2", "--json", cwd=workdir)
    plan = json.loads(proc.stdout)
    assert plan["world_size"] == 16
    assert plan["params_total"] == 6_738_415_616
    assert plan["batch"]["tokens_per_step"] == 256 * 4096


def test_plan_tables_show_the_numbers(workdir):
    out = trainctl("plan", "recipe=llama7b_fsdp", cwd=workdir).stdout
    assert "6,738,415,616" in out
    assert "torchrun" in out


def test_dry_run_writes_run_dir_and_starts_nothing(workdir):
    proc = trainctl("launch", "recipe=tiny_cpu", "--dry-run", "--name", "demo", cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    run_dir = workdir / "runs" / "demo"
    for name in ("config.yaml", "plan.json", "launch.sh", "code.json"):
        assert (run_dir / name).is_file(), name
    assert (run_dir / "logs").is_dir()
    assert not (run_dir / "metrics.jsonl").exists()  # nothing ran
    again = trainctl("launch", "recipe=tiny_cpu", "--dry-run", "--name", "demo", cwd=workdir)
    assert again.returncode == 0
    assert (workdir / "runs" / "demo-1" / "config.yaml").is_file()


# (arguments, fragments that must each appear in some error line, number of problems)
BAD_INPUTS = [
    (["plan", "model.dimm=3"], ["model.dimm"], 1),
    (["plan", "model=llama4"], ["model=llama4", "llama2_7b"], 1),
    (["plan", "recipe=nope"], ["recipe=nope", "tiny_cpu"], 1),
    (["config", "show", "train.steps=abc"], ["train.steps"], 1),
    (["plan", "recipe=tiny_cpu", "optim.lr=-1", "model.n_kv_heads=3", "schedule.warmup_steps=900"],
     ["optim.lr", "model.n_kv_heads", "schedule.warmup_steps"], 3),
    (["launch", "recipe=tiny_cpu", "train.global_batch=7"], ["train.global_batch"], 1),
    (["launch", "recipe=tiny_cpu", "train.seq_len=100000", "--dry-run"], ["train.seq_len"], 1),
    (["launch", "recipe=llama7b_fsdp", "cluster.procs_per_node=6", "sharding.tp=4"], ["sharding"], 1),
]


@pytest.mark.parametrize(("args", "fragments", "count"), BAD_INPUTS, ids=[" ".join(a) for a, _, _ in BAD_INPUTS])
def test_bad_input_exits_2_with_one_line_per_problem(args, fragments, count, workdir):
    proc = trainctl(*args, cwd=workdir)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) >= count and all(line.startswith("error: ") for line in lines), lines
    for fragment in fragments:
        assert any(fragment in line for line in lines), (fragment, lines)
    assert not (workdir / "runs").exists(), "bad input must not write a run directory"


def test_slurm_launch_without_sbatch_is_a_user_error(workdir, monkeypatch):
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    proc = trainctl("launch", "recipe=llama7b_fsdp", cwd=workdir)
    if proc.returncode == 0:
        pytest.fail("launch reported success without sbatch")
    assert proc.returncode == 2
    assert "sbatch" in proc.stderr and "Traceback" not in proc.stderr
    assert not (workdir / "runs").exists()


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "trainctl"
    assert script.exists(), "pip install -e . should install the trainctl console script"
    proc = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60, cwd=project_root())
    assert proc.returncode == 0 and "launch" in proc.stdout


def test_launch_refuses_what_the_worker_cannot_run_yet(workdir):
    # zero1 over tensor parallelism is a valid layout the worker does not run yet.
    overrides = ("recipe=llama3_8b_tp", "sharding.strategy=zero1", "sharding.dp_shard=1", "sharding.dp_replicate=-1")
    proc = trainctl("launch", *overrides, cwd=workdir)
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert any(line.startswith("error: sharding.strategy=zero1") for line in lines), lines
    assert not (workdir / "runs").exists()
    shown = trainctl("plan", *overrides, "--json", cwd=workdir)
    assert shown.returncode == 0
    assert any("is not implemented in the worker yet" in w for w in json.loads(shown.stdout)["warnings"])


def test_user_text_is_printed_literally(workdir):
    # rich would read [a,b] as markup and :warning: as an emoji code; an error must quote the user exactly.
    proc = trainctl("plan", "recipe=tiny_cpu", "optim.lr=:warning:", cwd=workdir)
    assert proc.returncode == 2
    assert "Value ':warning:'" in proc.stderr and "⚠" not in proc.stderr
    hint = trainctl("plan", "recipe=tiny_cpu", "optim.lr=[", cwd=workdir)
    assert hint.returncode == 2 and "key=[a,b]" in hint.stderr
