"""A local launch's device against this machine: the plan names what a rank really runs on, warns when the
machine lacks the GPU a config names, and launch refuses what cannot start (preflight)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import run_cli
from trainctl.config.compose import compose
from trainctl.config.validate import resolve
from trainctl.launch.preflight import launch_problems
from trainctl.plan.fit import Machine, device_label, device_warning, local_device_problems, this_machine
from trainctl.plan.runplan import build, refusal

H100 = "NVIDIA H100 80GB HBM3"
NO_GPU = Machine(())


def fake_root(tmp_path, models: list[str], devices: int):
    for i, model in enumerate(models):
        info = tmp_path / "proc/driver/nvidia/gpus" / f"0000:0{i}:00.0" / "information"
        info.parent.mkdir(parents=True)
        info.write_text(f"Model: \t\t {model}\nIRQ:   \t\t 42\nGPU UUID: \t GPU-{i}\n")
    (tmp_path / "dev").mkdir(exist_ok=True)
    for name in [f"nvidia{i}" for i in range(devices)] + ["nvidiactl", "nvidia-uvm", "null"]:
        (tmp_path / "dev" / name).write_text("")
    return tmp_path


def test_this_machine_reads_the_drivers_gpus_and_device_files(tmp_path):
    root = fake_root(tmp_path, [H100], devices=2)
    assert this_machine(root, environ={}).gpus == (H100, "")
    assert this_machine(root, environ={"CUDA_VISIBLE_DEVICES": "1"}).gpus == (H100,)
    for hidden in ("", "-1", " "):
        machine = this_machine(root, environ={"CUDA_VISIBLE_DEVICES": hidden})
        assert machine.gpus == () and machine.hidden_by.startswith("CUDA_VISIBLE_DEVICES=")
    assert this_machine(tmp_path / "empty", environ={}) == NO_GPU


def cfg_of(*overrides: str):
    return resolve(compose(list(overrides)))


BIG_ON_CPU = ("model=llama3_8b", "train.seq_len=1024", "cluster.gpu=h100")


def test_the_plan_names_the_cpu_a_cpu_run_uses_not_the_gpu_it_names():
    cfg = cfg_of(*BIG_ON_CPU)
    plan = build(cfg, with_advice=False, machine=NO_GPU)
    fit_line = next(w for w in plan.warnings if "does not fit" in w)
    assert "of one CPU worker" in fit_line and "h100" not in fit_line
    assert "of one CPU worker" in refusal(plan)
    assert any(w.startswith("cluster.gpu=h100: this machine has no NVIDIA GPU") for w in plan.warnings)


def test_on_a_machine_with_the_gpu_a_cpu_run_that_names_it_is_said_but_allowed():
    cfg = cfg_of("cluster.gpu=h100")
    assert device_warning(cfg.cluster, Machine((H100,))).startswith("cluster.gpu=h100 is not used: cluster.device=cpu")
    assert local_device_problems(cfg.cluster, Machine((H100,))) == []


@pytest.mark.parametrize(("machine", "fragment"), [
    (NO_GPU, "cluster.device=cuda: this machine has no NVIDIA GPU"),
    (Machine((), hidden_by="CUDA_VISIBLE_DEVICES=''"), "no NVIDIA GPU visible (CUDA_VISIBLE_DEVICES='' hides them)"),
    (Machine(("NVIDIA A100-SXM4-80GB",)), None),  # it starts; the plan warns (below)
    (Machine((H100,)), None),
])
def test_a_local_cuda_launch_needs_a_gpu_here(machine, fragment):
    cfg = cfg_of("recipe=llama1b_bench")
    problems = launch_problems(cfg, machine=machine)
    assert problems == ([] if fragment is None else [problems[0]])
    if fragment:
        assert fragment in problems[0] and "cluster.device=cpu" in problems[0] and "\n" not in problems[0]
        assert launch_problems(cfg, machine=machine, dry_run=True) == []  # a dry run starts nothing here


def test_more_workers_than_gpus_is_refused_and_a_gpu_of_another_kind_is_said():
    cfg = cfg_of("recipe=llama1b_bench", "cluster.procs_per_node=2", "sharding=ddp", "train.global_batch=16")
    (line,) = local_device_problems(cfg.cluster, Machine((H100,)))
    assert line.startswith("cluster.procs_per_node=2: one worker per GPU") and "cluster.procs_per_node=1" in line
    one = cfg_of("recipe=llama1b_bench")
    warning = device_warning(one.cluster, Machine(("NVIDIA A100-SXM4-80GB",)))
    assert warning.startswith("cluster.gpu=h100: this machine's GPU is NVIDIA A100-SXM4-80GB (a100_80gb)")
    assert device_warning(one.cluster, Machine((H100,))) is None  # h100 is h100_sxm's other name
    assert device_warning(one.cluster, Machine(("",))) is None  # a GPU of unknown model: nothing to say


def test_slurm_runs_are_not_compared_with_this_machine():
    cfg = cfg_of("recipe=llama7b_fsdp")
    assert device_warning(cfg.cluster, NO_GPU) is None and local_device_problems(cfg.cluster, NO_GPU) == []
    assert device_label("cuda", "") == "GPU" and device_label("cpu", "h100") == "CPU worker"


@pytest.mark.cli
def test_the_cli_plans_the_truth_and_launch_refuses_a_gpu_this_machine_lacks(tmp_path):
    import os

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU visible, whatever machine runs the test
    planned = run_cli("plan", *BIG_ON_CPU, "--json", cwd=tmp_path, env=env)
    assert planned.returncode == 0, planned.stderr
    warnings = json.loads(planned.stdout)["warnings"]
    assert any(w.startswith("cluster.gpu=h100: this machine has no NVIDIA GPU") for w in warnings), warnings
    assert not any("of one h100" in w for w in warnings)
    launched = run_cli("launch", "cluster.gpu=h100", "train.steps=20", cwd=tmp_path, env=env)
    assert launched.returncode == 2 and "Traceback" not in launched.stderr
    (line,) = launched.stderr.strip().splitlines()
    assert line.startswith("error: cluster.gpu=h100: this machine has no NVIDIA GPU") and "cluster.gpu=" in line
    assert not (tmp_path / "runs").exists()
