"""`trainctl launch` end to end, as a user types it: CLI -> run dir -> torchrun -> 2 gloo workers."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from worker_runs import TINY_OVERRIDES

from tests.faults.worker_faults import FAULTS_ENV, fault_env
from tests.helpers import cli_env, run_cli

pytestmark = pytest.mark.dist

# tiny_cpu, shrunk so the whole launch takes seconds on 2 cores.
SMALL = [
    *TINY_OVERRIDES,
    "train.steps=30",
    "train.eval_every=15",
    "train.eval_batches=4",
    "schedule.warmup_steps=3",
    "logging.log_every=5",
]


def launch(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return run_cli("launch", *args, cwd=tmp_path, timeout=300)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("cli")
    cache = tmp_path / "cache"
    proc = launch(tmp_path, "recipe=tiny_cpu", "sharding=fsdp", f"data.cache_dir={cache}", *SMALL, "--name", "fsdp")
    return tmp_path / "runs" / "fsdp", proc


def test_launch_trains_and_exits_zero(fsdp_run):
    run_dir, proc = fsdp_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["steps"] == 30
    assert result["final_val_loss"] < 0.8 * result["initial_val_loss"]


def test_rank0_output_streams_to_the_terminal(fsdp_run):
    _, proc = fsdp_run
    assert "eval step 0  val loss" in proc.stdout and "step 30/30  loss" in proc.stdout
    assert "run directory:" in proc.stdout


def test_run_directory_is_complete(fsdp_run):
    run_dir, _ = fsdp_run
    for name in ("config.yaml", "plan.json", "launch.sh", "code.json", "overrides.txt", "metrics.jsonl", "result.json",
                 "launch.json"):
        assert (run_dir / name).is_file(), name
    for rank in (0, 1):
        assert "train" in (run_dir / "logs" / f"rank{rank}.log").read_text()
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["world_size"] == 2 and plan["dims"]["dp_shard"] == 2
    assert "${RUN_DIR}" in (run_dir / "launch.sh").read_text()  # it finds its run directory from its own path
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [line for line in lines if line.get("kind") == "train"]
    assert [line["step"] for line in train] == [5, 10, 15, 20, 25, 30]
    assert train[-1]["loss"] < train[0]["loss"]
    assert json.loads((run_dir / "launch.json").read_text())["exit_code"] == 0


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k in ("step", "loss", "grad_norm", "val_loss")} for r in lines
            if r.get("kind") == kind]


def test_ranks_started_by_plain_torchrun_train_the_same_losses_bit_for_bit(fsdp_run, tmp_path):
    """cluster.rank_start=exec, each rank a new interpreter (plain torchrun, the cuda default), against the fixture's
    ranks forked by trainctl's agent (the cpu default): the same run, the same numbers to the last bit."""
    forked, _ = fsdp_run
    proc = launch(tmp_path, "recipe=tiny_cpu", "sharding=fsdp", f"data.cache_dir={forked.parent.parent / 'cache'}",
                  *SMALL, "cluster.rank_start=exec", "--name", "exec")
    run_dir = tmp_path / "runs" / "exec"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "-m torch.distributed.run " in (run_dir / "launch.sh").read_text()
    assert "-m trainctl.train.agent " in (forked / "launch.sh").read_text()
    assert records(run_dir, "train") == records(forked, "train") and len(records(run_dir, "train")) == 6
    assert records(run_dir, "eval") == records(forked, "eval") and records(run_dir, "eval")


def test_a_missing_data_file_is_refused_before_anything_starts(tmp_path):
    missing = tmp_path / "nope.bin"
    proc = launch(tmp_path, "recipe=tiny_cpu", "data=memmap", f"data.train_path={missing}", f"data.val_path={missing}",
                  *SMALL, "--name", "crash")
    assert proc.returncode == 2 and "data.train_path" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_worker_failure_names_the_first_rank_and_its_own_message_without_a_traceback(tmp_path):
    # Only the workers can see this one: the loss blows up at step 2 and the guard stops the run.
    proc = launch(tmp_path, "recipe=tiny_cpu", "optim.lr=1e6", "guards.nonfinite=stop",
                  f"data.cache_dir={tmp_path / 'cache'}", *SMALL,
                  "--name", "crash")
    run_dir = tmp_path / "runs" / "crash"
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "failed first" in last and "not finite" in last and str(run_dir / "logs") in last, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "Traceback" in (run_dir / "logs" / "launcher.log").read_text()  # torchrun's own, kept off the console
    assert "not finite" in (run_dir / "logs" / "rank0.log").read_text()
    record = json.loads((run_dir / "launch.json").read_text())
    assert record["state"] == "FAILED" and "not finite" in record["failure"]["message"]


def test_resume_relaunches_a_stopped_run_from_its_checkpoint(tmp_path):
    # The test-side stop fault acts like a preemption signal after step 12: checkpoint, exit 0, no result.
    env = cli_env(**fault_env(stop_after_step=12))
    args = ["launch", "recipe=tiny_cpu", f"data.cache_dir={tmp_path / 'cache'}", *SMALL, "--name", "stopped"]
    first = run_cli(*args, cwd=tmp_path, env=env, timeout=300)
    run_dir = tmp_path / "runs" / "stopped"
    assert first.returncode == 0, first.stderr[-3000:]
    assert not (run_dir / "result.json").exists() and (run_dir / "checkpoints" / "step-00000012").is_dir()
    env.pop(FAULTS_ENV)
    again = run_cli("resume", "stopped", cwd=tmp_path, env=env, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "from step-00000012" in again.stdout
    result = json.loads((run_dir / "result.json").read_text())
    assert result["resumed_from_step"] == 12 and result["steps"] == 30
    kinds = [json.loads(line)["kind"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert "resume" in kinds
    # A finished run has nothing left to train; an unknown run is a user error.
    for run, message in (("stopped", "already finished"), ("no-such-run", "no-such-run")):
        bad = run_cli("resume", run, cwd=tmp_path, env=env, timeout=60)
        assert bad.returncode == 2 and message in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
