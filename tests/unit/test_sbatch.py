"""The sbatch script: directives, the srun torchrun line as the shell expands it, quoting, and submission."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import wait_for, write_exe
from trainctl.config.schema import RunConfig, ShardingConfig, TrainConfig
from trainctl.config.slurm import PreemptionConfig, SlurmClusterConfig
from trainctl.launch.backends.slurm import script as slurm
from trainctl.launch.backends.slurm import setup_check as slurm_setup
from trainctl.launch.backends.slurm import submit as slurm_submit
from trainctl.launch.command import Expand, shell_join
from trainctl.launch.errors import LaunchError


def slurm_config(**cluster) -> RunConfig:
    # The job's Python is this interpreter (a bare `python` is a stub below that the script must never call).
    fields = {"launcher": "slurm", "nodes": 2, "procs_per_node": 4, "device": "cuda", "gpu": "h100",
              "python": sys.executable, **cluster}
    return RunConfig(
        sharding=ShardingConfig(strategy="fsdp", dp_shard=8),
        cluster=SlurmClusterConfig(**fields),
        train=TrainConfig(global_batch=8, micro_batch=1, grad_accum=1),
    )


def directives(script: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]


def render_directives(tmp_path: Path, **cluster) -> list[str]:
    return directives(slurm.render_sbatch(slurm_config(**cluster), tmp_path / "run-a"))


def test_directives_ask_for_nodes_one_task_each_and_the_gpus(tmp_path):
    run_dir = tmp_path / "run-a"
    lines = directives(slurm.render_sbatch(slurm_config(time_limit="02:30:00"), run_dir))
    assert "--nodes=2" in lines
    assert "--ntasks-per-node=1" in lines
    assert "--gpus-per-node=4" in lines
    assert "--time=02:30:00" in lines
    assert "--job-name=run-a" in lines
    assert f"--output={run_dir}/logs/slurm-%j.out" in lines
    assert "--open-mode=append" in lines  # requeued attempts add to the same file


def test_optional_keys_appear_only_when_set(tmp_path):
    unset = render_directives(tmp_path)
    unset_flags = ("--partition", "--account", "--qos", "--constraint", "--mem", "--exclusive")
    assert not [line for line in unset if line.startswith(unset_flags)]
    lines = render_directives(tmp_path, partition="gpu", account="proj7", qos="high", constraint="h100&ib", mem="480G",
                              exclusive=True, job_name="pretrain")
    assert {"--partition=gpu", "--account=proj7", "--qos=high", "--constraint=h100&ib", "--mem=480G", "--exclusive",
            "--job-name=pretrain"} <= set(lines)


@pytest.mark.parametrize(
    ("cluster", "expected"),
    [
        ({"cpus_per_task": 12, "cpu_threads": 6}, "--cpus-per-task=12"),  # explicit wins
        ({"cpu_threads": 6}, "--cpus-per-task=24"),  # threads x 4 workers
        ({}, "--cpus-per-task=4"),  # at least one CPU per worker, never Slurm's default of one per task
        ({"exclusive": True}, None),  # the whole node
    ],
)
def test_cpus_per_task(tmp_path, cluster, expected):
    cpus = [line for line in render_directives(tmp_path, **cluster) if line.startswith("--cpus-per-task")]
    assert cpus == ([expected] if expected else [])


@pytest.mark.parametrize(("cluster", "expected"),
                         [({"device": "cpu", "gpu": ""}, []), ({"gpus_per_node": 8}, ["--gpus-per-node=8"])])
def test_gpu_count_is_derived_or_configured(tmp_path, cluster, expected):
    assert [line for line in render_directives(tmp_path, **cluster) if line.startswith("--gpus")] == expected


def test_preemption_signal_goes_to_the_steps_with_its_lead_and_requeue(tmp_path):
    lines = render_directives(tmp_path, preemption=PreemptionConfig(signal="SIGUSR2", lead_s=300, requeue=True))
    assert "--signal=USR2@300" in lines  # no "B:": the batch shell is not where the workers are
    assert "--requeue" in lines
    lines = render_directives(tmp_path, preemption=PreemptionConfig(lead_s=0, requeue=False))
    assert not any(line.startswith("--signal") for line in lines)
    assert "--no-requeue" in lines


def test_extra_directives_come_last_verbatim(tmp_path):
    lines = render_directives(tmp_path, extra_directives=["--reservation=big run", "--mail-type=END"])
    assert lines[-2:] == ["--reservation=big run", "--mail-type=END"]


@pytest.mark.parametrize(
    ("cluster", "run_name"),
    [({"job_name": "a\nb"}, "run"), ({"partition": "gpu\n#SBATCH --qos=x"}, "run"),
     ({"extra_directives": ["--x=1\necho hi"]}, "run"), ({}, "run%x")],
)
def test_render_refuses_what_would_break_a_directive(tmp_path, cluster, run_name):
    with pytest.raises(LaunchError):
        slurm.render_sbatch(slurm_config(**cluster), tmp_path / run_name)


def test_torchrun_forwards_the_preemption_signal_and_torchruns_defaults(tmp_path):
    script = slurm.render_sbatch(slurm_config(preemption=PreemptionConfig(signal="SIGUSR1")), tmp_path / "r")
    assert "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in script
    assert "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=120" in script.splitlines()


# --- the script as a compute node runs it: stub srun/scontrol record what they receive ---

SLURM_ENV = {"SLURM_JOB_NODELIST": "node[017-018]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242",
             "SLURM_CPUS_ON_NODE": "32"}


def stub_bin(tmp_path: Path, srun_exit: int = 0) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    # More names than a pipe buffer holds: a `scontrol | head -n 1` under pipefail would die of SIGPIPE every time.
    write_exe(bin_dir / "scontrol", "echo node017\nfor i in $(seq 20000); do echo node-spare-$i; done\n")
    write_exe(bin_dir / "srun",
              f'printf "%s\\n" "$@" > {tmp_path}/srun_args\nenv > {tmp_path}/srun_env\nexit {srun_exit}\n')
    for name in ("torchrun", "python", "sbatch"):  # anything the script should never call directly
        write_exe(bin_dir / name, f"touch {tmp_path}/called-{name}\n")
    return bin_dir


def run_script(tmp_path: Path, cfg: RunConfig, run_dir: Path, workdir: Path | None = None, srun_exit: int = 0,
               **env) -> subprocess.CompletedProcess:
    bin_dir = stub_bin(tmp_path, srun_exit)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    script = run_dir / "launch.sh"
    script.write_text(slurm.render_sbatch(cfg, run_dir, workdir=workdir or tmp_path))
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    full_env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", **SLURM_ENV, **env}
    return subprocess.run(["bash", str(script)], env=full_env, capture_output=True, text=True, timeout=30)


@pytest.mark.cli
def test_script_expands_to_one_torchrun_per_node_with_c10d_rendezvous(tmp_path):
    run_dir = tmp_path / "run-b"
    done = run_script(tmp_path, slurm_config(rdzv_port=29511, max_restarts=2), run_dir)
    assert done.returncode == 0, done.stderr
    args = (tmp_path / "srun_args").read_text().splitlines()
    assert args[:2] == ["--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    assert "--cpus-per-task=32" in args
    assert f"--output={run_dir}/logs/slurm-4242.0.out" in args  # job id and attempt in the workers' log name
    for expected in ("--nnodes=2", "--nproc-per-node=4", "--rdzv-backend=c10d", "--rdzv-endpoint=node017:29511",
                     "--rdzv-id=4242", "--max-restarts=2"):
        assert expected in args
    assert args[-3:] == ["-m", "trainctl.train", str(run_dir)]
    env = dict(line.split("=", 1) for line in (tmp_path / "srun_env").read_text().splitlines() if "=" in line)
    assert env["OMP_NUM_THREADS"] == "8"  # 32 CPUs shared by 4 workers
    assert env["MASTER_ADDR"] == "node017"


@pytest.mark.cli
def test_attempts_are_recorded_and_the_exit_code_passes_through(tmp_path):
    run_dir = tmp_path / "run-c"
    done = run_script(tmp_path, slurm_config(), run_dir, srun_exit=3, SLURM_RESTART_COUNT="2")
    assert done.returncode == 3
    records = [json.loads(line) for line in (run_dir / slurm.ATTEMPTS_FILE).read_text().splitlines()]
    assert [(r["event"], r["job_id"], r["attempt"], r["exit_code"]) for r in records] == [
        ("start", "4242", 2, None), ("end", "4242", 2, 3)]
    assert records[0]["nodes"] == "node[017-018]"


@pytest.mark.cli
def test_an_attempt_beyond_max_requeues_stops_before_srun(tmp_path):
    cfg = slurm_config(preemption=PreemptionConfig(max_requeues=3))
    done = run_script(tmp_path, cfg, tmp_path / "run-d", SLURM_RESTART_COUNT="4")
    assert done.returncode == 1 and "max_requeues=3" in done.stderr
    assert not (tmp_path / "srun_args").exists()
    assert run_script(tmp_path, cfg, tmp_path / "run-e", SLURM_RESTART_COUNT="3").returncode == 0


HOSTILE = [
    "x$(touch {p}/pwned-1)",
    "x`touch {p}/pwned-2`",
    "x; touch {p}/pwned-3",
    "x' ; touch {p}/pwned-4 ; '",
    'x" ; touch {p}/pwned-5 ; "',
    "x\ntouch {p}/pwned-6\n",
    "x$'\\n'$(touch {p}/pwned-7)\\",
]


@pytest.mark.cli
def test_hostile_config_values_are_inert(tmp_path):
    """Job name, env values, run and work directories full of shell syntax: nothing runs, every value arrives intact."""
    values = [v.format(p=tmp_path) for v in HOSTILE]
    env = {f"HOSTILE_{i}": v for i, v in enumerate(values)}
    cfg = slurm_config(job_name=f"x$(touch${{IFS}}{tmp_path}/pwned-job)`touch`;'\"", env=env)
    run_dir = tmp_path / "run$(touch${IFS}pwned-run)`touch${IFS}pwned-run2`;'x'\""
    workdir = tmp_path / "work dir $(touch pwned-wd) ; `x`"
    workdir.mkdir()
    done = run_script(tmp_path, cfg, run_dir, workdir=workdir)
    assert done.returncode == 0, done.stderr
    assert not [p.name for p in tmp_path.rglob("pwned*")] and not list(workdir.rglob("pwned*"))
    assert not list(tmp_path.glob("called-*"))
    srun_env = (tmp_path / "srun_env").read_text()
    for i, value in enumerate(values):
        assert f"HOSTILE_{i}={value}" in srun_env
    args = (tmp_path / "srun_args").read_text().splitlines()
    assert args[-1] == str(run_dir)
    assert f"--log-dir={run_dir}/logs/torchrun" in args
    assert (run_dir / slurm.ATTEMPTS_FILE).is_file()  # the quoted RUN_DIR was used as a path, literally


@pytest.mark.cli
def test_only_our_own_templates_are_expanded(tmp_path):
    """A path that happens to contain `${` is still quoted literally (it once was double-quoted, so `$(...)` ran)."""
    literal = f"{tmp_path}/a${{IFS}}$(touch${{IFS}}{tmp_path}/pwned)"
    line = shell_join(["printf", "%s\\n", literal, Expand("${HOME}")])
    done = subprocess.run(["bash", "-c", line], capture_output=True, text=True, env={**os.environ, "HOME": "/h"})
    assert done.stdout.splitlines() == [literal, "/h"]
    assert not (tmp_path / "pwned").exists()


def test_hostile_job_name_stays_inside_its_directive(tmp_path):
    script = slurm.render_sbatch(slurm_config(job_name="x$(touch/tmp/pwned)"), tmp_path / "r")
    assert [line for line in script.splitlines() if "touch" in line] == ["#SBATCH --job-name=x$(touch/tmp/pwned)"]


@pytest.mark.cli
def test_setup_lines_are_verbatim_marked_and_run(tmp_path):
    setup = ['echo "setup ran in $PWD" > setup.out', "export FROM_SETUP=$((6 * 7))",
             'echo "${UNSET_IN_MODULE_SCRIPTS:-}" >/dev/null']
    cfg = slurm_config(setup=setup)
    lines = slurm.render_sbatch(cfg, tmp_path / "r").splitlines()
    begin, end = lines.index(slurm.SETUP_BEGIN), lines.index(slurm.SETUP_END)
    assert [line for line in lines[begin + 1 : end] if not line.startswith("set ")] == setup
    done = run_script(tmp_path, cfg, tmp_path / "run-f")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "setup.out").read_text().startswith("setup ran in ")
    assert "FROM_SETUP=42" in (tmp_path / "srun_env").read_text()


@pytest.mark.cli
def test_user_env_can_override_our_defaults(tmp_path):
    run_script(tmp_path, slurm_config(env={"OMP_NUM_THREADS": "3"}), tmp_path / "run-g")
    assert "OMP_NUM_THREADS=3\n" in (tmp_path / "srun_env").read_text()


# --- submission ---


def test_submit_without_sbatch_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LaunchError, match="sbatch was not found on PATH"):
        slurm_submit.submit(tmp_path)


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


@pytest.mark.cli
def test_submit_returns_the_job_id_and_records_it(fake_sbatch, run_dir, tmp_path):
    write_exe(fake_sbatch, f'printf "%s\\n" "$@" > {tmp_path}/sbatch_args\necho "9876;cluster-a"\n')
    assert slurm_submit.submit(run_dir) == "9876"
    assert (tmp_path / "sbatch_args").read_text().splitlines() == ["--parsable", str(run_dir / "launch.sh")]
    assert json.loads((run_dir / "launch.json").read_text())["job_id"] == "9876"


@pytest.mark.cli
def test_submit_reports_sbatch_rejection(fake_sbatch, run_dir):
    write_exe(fake_sbatch, 'echo "sbatch: error: invalid partition specified: gpu" >&2\nexit 1\n')
    with pytest.raises(LaunchError, match="invalid partition"):
        slurm_submit.submit(run_dir)
    assert not (run_dir / "launch.json").exists()


def test_launch_scripts_give_restarted_workers_a_fresh_rendezvous_store(tmp_path):
    # Without it torchrun's restarts hang (see trainctl.launch.command.TORCHRUN_ENV).
    from trainctl.config.schema import ClusterConfig
    from trainctl.launch.backends.local import launcher as local

    line = "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
    assert line in local.render_script(ClusterConfig(), tmp_path / "run").splitlines()
    assert line in slurm.render_sbatch(slurm_config(), tmp_path / "run-a").splitlines()


# ---------------------------------------------------------------- cluster.setup must not break the script


@pytest.mark.cli
@pytest.mark.parametrize(
    ("setup", "blamed", "why"),
    [
        (["if true; then"], "cluster.setup:", "unexpected end of file"),
        (["module load cuda", "echo 'unclosed"], "cluster.setup[1]=", "matching"),
        (['echo "a'], "cluster.setup[0]=", "matching"),
        (["fi"], "cluster.setup[0]=", "unexpected token"),
        (["echo ${x"], "cluster.setup[0]=", "matching"),
        # bash exits 0 on these two, but they swallow or join trainctl's own lines
        (["cat <<EOF"], "cluster.setup[0]=", "here-document"),
        (["module load a", "module load b \\"], "cluster.setup[1]=", "line continuation"),
    ],
)
def test_setup_that_breaks_the_script_is_one_line_before_anything_is_written(tmp_path, setup, blamed, why):
    cfg = slurm_config(setup=setup)
    (line,) = slurm.setup_problems(cfg)
    assert line.startswith(blamed) and why in line
    with pytest.raises(LaunchError, match="cluster.setup"):
        slurm.render_sbatch(cfg, tmp_path / "run-a")


@pytest.mark.cli
@pytest.mark.parametrize(
    "setup",
    [
        [],
        ["module load cuda/12.4", "source ~/venv/bin/activate"],
        ["if [ -f ~/.env ]; then", "  . ~/.env", "fi"],  # one construct across entries is fine
        ["export X='a b' Y=\"${HOME}\"", "echo \\\\"],
        ["cat > f <<'EOF'\nline\nEOF"],  # a complete here-document in one entry
    ],
)
def test_setup_that_parses_passes(tmp_path, setup):
    cfg = slurm_config(setup=setup)
    assert slurm.setup_problems(cfg) == []
    assert slurm.render_sbatch(cfg, tmp_path / "run-a")


@pytest.mark.cli
def test_bash_syntax_error_reports_line_and_message():
    assert slurm_setup.bash_syntax_error("echo ok\n") is None
    line, message = slurm_setup.bash_syntax_error("echo ok\nfi\n")
    assert line == 2 and "fi" in message


@pytest.mark.cli
def test_the_batch_script_refuses_to_train_while_another_trainer_holds_the_run(tmp_path):
    run_dir = tmp_path / "run-a"
    run_dir.mkdir()
    script = slurm.render_sbatch(slurm_config(), run_dir)
    lines = script.splitlines()
    # The script's own lines up to (and including) taking the lock, then a marker.
    head = lines[: next(i for i, line in enumerate(lines) if line == "unset TRAINCTL_LOCK_FD") + 1] + ["echo locked"]
    (tmp_path / "head.sh").write_text("\n".join(head) + "\n")
    env = {**os.environ, "SLURM_JOB_ID": "77", "SLURM_CPUS_ON_NODE": "2"}  # the lock is taken after the exports
    holder = subprocess.Popen(["flock", str(run_dir / "trainer.lock"), "sleep", "30"], start_new_session=True)
    try:
        wait_for(lambda: subprocess.run(["flock", "-n", str(run_dir / "trainer.lock"), "true"]).returncode != 0,
                 "the holder to take the lock", timeout=10, proc=holder)
        refused = subprocess.run(["bash", str(tmp_path / "head.sh")], capture_output=True, text=True, env=env)
        assert refused.returncode == 2 and "is being trained by" in refused.stderr and "locked" not in refused.stdout
    finally:
        os.killpg(holder.pid, 9)  # flock and the sleep that holds the lock
        holder.wait()
    taken = subprocess.run(["bash", str(tmp_path / "head.sh")], capture_output=True, text=True, env=env)
    assert taken.returncode == 0 and taken.stdout.strip() == "locked", taken.stderr
    assert json.loads((run_dir / "trainer.json").read_text())["slurm_job_id"] == "77"
