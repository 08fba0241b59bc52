"""Containers on Slurm: the job's Python (`cluster.python`), pyxis images and mounts, an exec prefix, srun options."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import write_exe
from tests.unit.test_sbatch import run_script, slurm_config
from trainctl.config.compose import compose
from trainctl.config.errors import ConfigError
from trainctl.config.slurm import ContainerConfig
from trainctl.config.validate import resolve
from trainctl.launch.backends.slurm import script as slurm


def srun_words(script: str) -> list[str]:
    """The workers' srun line of a script, as the shell splits it (its ${...} left unexpanded)."""
    (line,) = [line for line in script.splitlines() if line.startswith("srun ") and "torch.distributed.run" in line]
    return shlex.split(line.removesuffix(" || STATUS=$?"))


def bookkeeping_lines(script: str) -> list[str]:
    return [line for line in script.splitlines() if "-m trainctl.core.rundir" in line]


def test_the_job_runs_python_from_its_path_not_the_launching_venv(tmp_path):
    script = slurm.render_sbatch(slurm_config(python="python"), tmp_path / "r")
    words = srun_words(script)
    assert words[words.index("-m") - 1:words.index("-m") + 2] == ["python", "-m", "torch.distributed.run"]
    assert sys.executable not in script
    assert all(re.search(r"(^|[ ])python -m trainctl.core.rundir", line) for line in bookkeeping_lines(script))



def test_the_job_python_defaults_to_the_launching_interpreter_and_to_the_images_python(tmp_path):
    assert compose(["cluster=slurm"]).cluster.python == ""  # the default: chosen by where the job runs
    words = srun_words(slurm.render_sbatch(slurm_config(python=""), tmp_path / "r"))
    assert words[words.index("-m") - 1] == sys.executable  # no container: the venv that launched it
    for container in (ContainerConfig(image="img.sqsh"), ContainerConfig(exec="apptainer exec x.sif")):
        words = srun_words(slurm.render_sbatch(slurm_config(python="", container=container), tmp_path / "r"))
        assert words[words.index("-m") - 1] == "python"  # the image's own


def test_the_job_checks_its_python_imports_trainctl_before_the_lock_and_torchrun(tmp_path):
    script = slurm.render_sbatch(slurm_config(python="", container=ContainerConfig(image="img.sqsh")),
                                 tmp_path / "r")
    lines = script.splitlines()
    check = next(i for i, line in enumerate(lines) if "-c 'import trainctl, torch'" in line)
    assert lines[check].startswith("if ! srun --nodes=1 --ntasks=1") and "--container-image=img.sqsh" in lines[check]
    assert "cannot import trainctl and torch; install torch and the dependencies of trainctl in" in lines[check + 1]
    assert lines[check + 2:check + 4] == ["  exit 1", "fi"]
    assert check < min(i for i, line in enumerate(lines) if "trainctl.core.rundir" in line or "torch.distributed" in
                        line)


def test_the_image_sees_the_run_and_trainctls_code_by_default_and_the_header_says_so(tmp_path):
    import trainctl

    run_dir = tmp_path / "runs" / "r"
    code = Path(trainctl.__file__).resolve().parent
    script = slurm.render_sbatch(slurm_config(container=ContainerConfig(image="img.sqsh", mounts=["/d:/d"])), run_dir)
    mounts = f"--container-mounts={run_dir.parent}:{run_dir.parent},{code}:/opt/trainctl/code/trainctl:ro,/d:/d"
    assert mounts in srun_words(script)
    assert f"#   {code}:/opt/trainctl/code/trainctl:ro  (the launcher's trainctl, on PYTHONPATH)" in script
    assert f"#   {run_dir.parent}:{run_dir.parent}  (the runs folder, at the same path)" in script
    assert 'export PYTHONPATH=/opt/trainctl/code"${PYTHONPATH:+:$PYTHONPATH}"' in script.splitlines()
    off = slurm.render_sbatch(slurm_config(container=ContainerConfig(image="img.sqsh", default_mounts=False)),
                              run_dir)
    assert "--container-mounts" not in off and "PYTHONPATH" not in off and "no mounts" in off
    mine = ContainerConfig(image="img.sqsh", mounts=[f"/elsewhere:{run_dir.parent}"])  # the user's wins
    assert f"--container-mounts={code}:/opt/trainctl/code/trainctl:ro,/elsewhere:{run_dir.parent}" in srun_words(
        slurm.render_sbatch(slurm_config(container=mine), run_dir))


def test_one_export_of_each_torchrun_variable(tmp_path):
    script = slurm.render_sbatch(slurm_config(), tmp_path / "r")
    exports = [line for line in script.splitlines() if line.startswith("export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=")]
    assert exports == ["export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=120"]  # the preemption lead, once


def test_the_launching_interpreter_and_an_explicit_one_are_checked_before_submitting(tmp_path):
    from trainctl.launch.backends.slurm import job_python

    assert job_python.local_problems(slurm_config(python="").cluster) == []  # this interpreter has both
    assert job_python.local_problems(slurm_config(python="no-such-python-here").cluster) == []  # the nodes' own


@pytest.mark.cli  # runs the named interpreter
def test_an_explicit_interpreter_without_trainctl_is_refused_in_one_line(tmp_path):
    from trainctl.launch.backends.slurm import job_python

    bare = tmp_path / "python3"
    write_exe(bare, 'echo "ModuleNotFoundError: No module named \'torch\'" >&2\nexit 1\n')
    (line,) = job_python.local_problems(slurm_config(python=str(bare)).cluster)
    assert line == (f"cluster.python={bare}: cannot import trainctl and torch (ModuleNotFoundError: No module named "
                    f"'torch'); give the environment's interpreter (e.g. {sys.executable}) or install them there")
    assert job_python.local_problems(slurm_config(python=sys.executable).cluster) == []


@pytest.mark.cli  # rendering cluster.setup checks it with bash -n
def test_the_jobs_python_is_found_after_cluster_setup(tmp_path):
    """After cluster.setup (where `module load` or `conda activate` puts it on PATH), before the lock is taken."""
    script = slurm.render_sbatch(slurm_config(python="python", setup=["module load x"]), tmp_path / "r")
    lines = script.splitlines()
    first_python = next(i for i, line in enumerate(lines) if "python -m trainctl.core.rundir" in line)
    assert lines.index(slurm.SETUP_END) < first_python


def test_a_pyxis_image_and_its_mounts_go_on_every_srun(tmp_path):
    cfg = slurm_config(python="python3", container=ContainerConfig(image="nvcr.io#nvidia/pytorch:25.01-py3",
                                                            mounts=["/data:/data:ro", "/scratch:/scratch"]))
    script = slurm.render_sbatch(cfg, tmp_path / "r")
    words = srun_words(script)
    image = "--container-image=nvcr.io#nvidia/pytorch:25.01-py3"
    mounts = next(w for w in words if w.startswith("--container-mounts="))
    assert mounts.endswith(",/data:/data:ro,/scratch:/scratch")  # after the default mounts
    assert image in words and words.index(mounts) < words.index("python3")
    # The batch shell's own Python (lock holder, finished run) runs in the image too: one task on one node.
    step = ["srun", "--nodes=1", "--ntasks=1", "--kill-on-bad-exit=1", image, mounts, "python3", "-m"]
    for line in bookkeeping_lines(script):
        words = shlex.split(line)
        assert words[words.index("srun"):words.index("srun") + len(step)] == step


def test_an_exec_prefix_wraps_the_workers_and_the_bookkeeping_literally(tmp_path):
    prefix = "apptainer exec --nv '/images/my train.sif' $(touch /tmp/pwned)"
    script = slurm.render_sbatch(slurm_config(python="python", container=ContainerConfig(exec=prefix)), tmp_path / "r")
    words = srun_words(script)
    start = words.index("apptainer")
    assert words[start:start + 7] == ["apptainer", "exec", "--nv", "/images/my train.sif", "$(touch", "/tmp/pwned)",
                                      "python"]
    quoted = "apptainer exec --nv '/images/my train.sif' '$(touch' '/tmp/pwned)' python"
    assert quoted in script  # each word quoted: the prefix runs no shell of its own
    assert all(quoted + " -m trainctl.core.rundir" in line for line in bookkeeping_lines(script))


def test_srun_args_come_before_trainctls_own_output_options(tmp_path):
    script = slurm.render_sbatch(slurm_config(srun_args=["--mpi=none", "--network=sn_all"]), tmp_path / "r")
    words = srun_words(script)
    output = next(i for i, w in enumerate(words) if w.startswith("--output="))
    assert words.index("--mpi=none") < words.index("--network=sn_all") < output  # the later option wins in srun


BASE = ["recipe=tiny_cpu", "cluster=slurm", "cluster.device=cpu", "cluster.gpu=", "cluster.procs_per_node=2"]
BAD = [
    (["cluster.container.image=img.sqsh", "cluster.container.exec=apptainer exec x.sif"],
     "cluster.container.image='img.sqsh' and cluster.container.exec='apptainer exec x.sif': choose one"),
    (["cluster.container.mounts=[/data:/data]"], "cluster.container.mounts: pyxis mounts need cluster.container.image"),
    (["cluster.container.image=img.sqsh", "cluster.container.mounts=[/data]"],
     "cluster.container.mounts[0]='/data': use SRC:DST[:FLAGS]"),
    (["cluster.container.image=img.sqsh", "cluster.container.mounts=['/a:/b,/c:/d']"],
     "cluster.container.mounts[0]='/a:/b,/c:/d': use SRC:DST[:FLAGS]"),
    (["cluster.container.image=img.sqsh", "cluster.container.mounts=[/data:data]"],
     "cluster.container.mounts[0]='/data:data': use SRC:DST[:FLAGS] with an absolute DST"),
    (["cluster.container.image='a b'"], "cluster.container.image='a b': one image name or path"),
    (["cluster.container.exec='apptainer exec \"x.sif'"], "cluster.container.exec='apptainer exec \"x.sif': "),
    (["cluster.python='conda run python'"], "cluster.python='conda run python': one command or path without spaces"),
    (["cluster.python=' '"], "cluster.python=' ': one command or path"),
    (["cluster.srun_args=['mpi=none']"], "cluster.srun_args[0]='mpi=none': one srun option per entry"),
]


@pytest.mark.parametrize(("overrides", "expected"), BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_container_settings_are_one_line_each(overrides, expected):
    with pytest.raises(ConfigError) as err:
        resolve(compose([*BASE, *overrides]))
    (line,) = err.value.problems
    assert line.startswith(expected)


def test_good_container_settings_pass():
    for overrides in (["cluster.container.image='nvcr.io#nvidia/pytorch:25.01-py3'",
                       "cluster.container.mounts=[/data:/data:ro,/home/me:/home/me]"],
                      ["cluster.container.exec=apptainer exec --nv /images/train.sif", "cluster.python=python3"],
                      ["cluster.srun_args=['--mpi=none']", "cluster.python=/opt/venv/bin/python"]):
        resolve(compose([*BASE, *overrides]))


@pytest.mark.cli
def test_the_prefix_wraps_what_the_script_runs(tmp_path):
    """Run the script with stub srun/scontrol: the bookkeeping goes through the prefix, and srun starts it too."""
    wrapper = tmp_path / "wrap"
    write_exe(wrapper, f'echo "$*" >> {tmp_path}/wrapped\n[ "$1" = --flag ] && shift\nexec "$@"\n')
    run_dir = tmp_path / "run-w"
    cfg = slurm_config(python=sys.executable, container=ContainerConfig(exec=f"{wrapper} --flag"))
    done = run_script(tmp_path, cfg, run_dir)
    assert done.returncode == 0, done.stderr
    check, *wrapped = (tmp_path / "wrapped").read_text().splitlines()
    assert check == f"--flag {sys.executable} -c import trainctl, torch"  # the job's Python checked first
    assert [w.split()[:4] for w in wrapped] == [["--flag", sys.executable, "-m", "trainctl.core.rundir"]] * 2
    assert [w.split()[4] for w in wrapped] == ["hold", "completed"]
    args = (tmp_path / "srun_args").read_text().splitlines()
    assert args[args.index(str(wrapper)):args.index(str(wrapper)) + 4] == [str(wrapper), "--flag", sys.executable,
                                                                            "-m"]
    assert Path(run_dir / "trainer.json").is_file()  # the holder was recorded through the prefix


def run_preempted_script(tmp_path: Path, stopped_before_attempt: bool) -> list[str]:
    """The script with srun stubbed as workers stopped by SIGUSR2; what the stub scontrol was asked to requeue."""
    from tests.unit.test_sbatch import SLURM_ENV, stub_bin

    run_dir = tmp_path / "run-p"
    (run_dir / "logs").mkdir(parents=True)
    bin_dir = stub_bin(tmp_path)
    stopped = '{"step": 5, "signal": "SIGUSR2", "checkpoint": "step-00000005"}'
    if stopped_before_attempt:  # an earlier attempt's record, older than this attempt's start
        (run_dir / "stopped.json").write_text(stopped)
        os.utime(run_dir / "stopped.json", (1, 1))
        write_exe(bin_dir / "srun", "exit 1\n")
    else:
        write_exe(bin_dir / "srun", f"echo '{stopped}' > {run_dir}/stopped.json\nexit 1\n")
    write_exe(bin_dir / "scontrol", f'if [ "$1" = requeue ]; then echo "$2" >> {tmp_path}/requeued; exit 0; fi\n'
                                    "echo node017\n")
    script = run_dir / "launch.sh"
    script.write_text(slurm.render_sbatch(slurm_config(), run_dir, workdir=tmp_path))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", **SLURM_ENV}
    subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    return (tmp_path / "requeued").read_text().split() if (tmp_path / "requeued").exists() else []


@pytest.mark.cli
def test_the_batch_shell_requeues_what_its_workers_stopped_for_preemption(tmp_path):
    """Rank 0's `scontrol requeue` cannot run in a container without Slurm's client: the batch shell does it."""
    assert run_preempted_script(tmp_path / "now", stopped_before_attempt=False) == ["4242"]
    assert run_preempted_script(tmp_path / "old", stopped_before_attempt=True) == []


@pytest.mark.cli  # it tries to start scontrol
def test_a_worker_without_scontrol_leaves_the_requeue_to_the_batch_shell(monkeypatch, tmp_path):
    from trainctl.train.loop import stop
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol here
    assert stop.requeue_slurm_job() is False
