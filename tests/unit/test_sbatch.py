"""The sbatch script: directives, the srun torchrun line as the shell expands it, and submission."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from trainctl.config.schema import ClusterConfig, RunConfig, ShardingConfig, TrainConfig
from trainctl.launch import slurm
from trainctl.launch.errors import LaunchError


def slurm_config(**cluster) -> RunConfig:
    fields = {"name": "slurm", "launcher": "slurm", "nodes": 2, "procs_per_node": 4, "device": "cuda", "gpu": "h100", **cluster}
    return RunConfig(
        sharding=ShardingConfig(name="fsdp", strategy="fsdp", dp_shard=8),
        cluster=ClusterConfig(**fields),
        train=TrainConfig(global_batch=8, micro_batch=1, grad_accum=1),
    )


def directives(script: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]


def write_exe(path: Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)


def test_directives_ask_for_nodes_one_task_each_and_the_gpus(tmp_path):
    run_dir = tmp_path / "run-a"
    lines = directives(slurm.render_sbatch(slurm_config(time_limit="02:30:00"), run_dir))
    assert "--nodes=2" in lines
    assert "--ntasks-per-node=1" in lines
    assert "--gpus-per-node=4" in lines
    assert "--time=02:30:00" in lines
    assert "--job-name=run-a" in lines
    assert f"--output={run_dir}/logs/slurm-%j.out" in lines


def test_optional_keys_appear_only_when_set(tmp_path):
    unset = directives(slurm.render_sbatch(slurm_config(), tmp_path))
    assert not [line for line in unset if line.startswith(("--partition", "--account", "--qos"))]
    lines = directives(slurm.render_sbatch(slurm_config(partition="gpu", account="proj7", qos="high"), tmp_path))
    assert {"--partition=gpu", "--account=proj7", "--qos=high"} <= set(lines)


def test_cpus_per_task_from_cpu_threads_else_whole_nodes(tmp_path):
    assert "--cpus-per-task=24" in directives(slurm.render_sbatch(slurm_config(cpu_threads=6), tmp_path))
    lines = directives(slurm.render_sbatch(slurm_config(), tmp_path))
    assert "--exclusive" in lines and not any(line.startswith("--cpus-per-task") for line in lines)


def test_cpu_cluster_asks_for_no_gpus(tmp_path):
    lines = directives(slurm.render_sbatch(slurm_config(device="cpu", gpu=""), tmp_path))
    assert not any(line.startswith("--gpus") for line in lines)


def test_script_expands_to_one_torchrun_per_node_with_c10d_rendezvous(tmp_path):
    """Run the script with fake srun/scontrol that record what they receive, as on a compute node."""
    bin_dir, run_dir = tmp_path / "bin", tmp_path / "run dir"  # a space, to check quoting
    bin_dir.mkdir()
    # More names than a pipe buffer holds: a `scontrol | head -n 1` under pipefail would die of SIGPIPE every time.
    write_exe(bin_dir / "scontrol", "echo node017\nfor i in $(seq 20000); do echo node-spare-$i; done\n")
    write_exe(bin_dir / "srun", f'printf "%s\\n" "$@" > {tmp_path}/srun_args\necho "$OMP_NUM_THREADS" > {tmp_path}/omp\n')
    script = tmp_path / "launch.sh"
    script.write_text(slurm.render_sbatch(slurm_config(rdzv_port=29511, max_restarts=2), run_dir, workdir=tmp_path))
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "node[017-018]",
        "SLURM_NNODES": "2",
        "SLURM_JOB_ID": "4242",
        "SLURM_CPUS_ON_NODE": "32",
    }
    subprocess.run(["bash", str(script)], env=env, check=True, timeout=30)
    args = (tmp_path / "srun_args").read_text().splitlines()
    assert "--cpus-per-task=32" in args
    for expected in (
        "--nnodes=2",
        "--nproc_per_node=4",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=node017:29511",
        "--rdzv_id=4242",
        "--max_restarts=2",
    ):
        assert expected in args
    assert args[-3:] == ["-m", "trainctl.train", str(run_dir)]
    assert (tmp_path / "omp").read_text().strip() == "8"  # 32 CPUs shared by 4 workers


def test_submit_without_sbatch_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LaunchError, match="sbatch was not found on PATH"):
        slurm.submit(tmp_path)


@pytest.fixture
def fake_sbatch(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return bin_dir / "sbatch"


@pytest.fixture
def run_dir(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "launch.sh").write_text(slurm.render_sbatch(slurm_config(), run_dir))
    return run_dir


def test_submit_returns_the_job_id_and_records_it(fake_sbatch, run_dir, tmp_path):
    write_exe(fake_sbatch, f'printf "%s\\n" "$@" > {tmp_path}/sbatch_args\necho "9876;cluster-a"\n')
    assert slurm.submit(run_dir) == "9876"
    assert (tmp_path / "sbatch_args").read_text().splitlines() == ["--parsable", str(run_dir / "launch.sh")]
    assert json.loads((run_dir / "launch.json").read_text())["job_id"] == "9876"


def test_submit_reports_sbatch_rejection(fake_sbatch, run_dir):
    write_exe(fake_sbatch, 'echo "sbatch: error: invalid partition specified: gpu" >&2\nexit 1\n')
    with pytest.raises(LaunchError, match="invalid partition"):
        slurm.submit(run_dir)
    assert not (run_dir / "launch.json").exists()
