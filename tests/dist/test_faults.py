"""Faults on 2 gloo workers under torchrun: a killed worker, a kill during a save, damaged shards, a full disk.

Every run is the same 16-step fp32 DDP run (checkpoint every 4 steps, keep 3), bitwise-reproducible on CPU:
whatever happens to it, the losses it finally records (the last train record of each step; a restart
supersedes what an earlier attempt logged after its checkpoint) must equal the uninterrupted run's exactly.
The damaged-shard cases rerun a copy of that finished reference run (its checkpoints 8, 12, 16) rather than
a run of their own: one torchrun start less per case.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest
from worker_runs import WORKER_TIMEOUT_S, base_config, records, run_worker, write_run_dir

from tests.faults.worker_faults import fault_env
from tests.helpers import torchrun_cmd, truncate, wait_for, worker_env
from trainctl.config.schema import CheckpointConfig, RunConfig, ShardingConfig
from trainctl.launch.command import TORCHRUN_ENV  # what the launch scripts export: restarts need it
from trainctl.train.checkpoint.store import checkpoint_dir, list_committed, step_name, verify

pytestmark = pytest.mark.dist

STEPS, EVERY, KEEP = 16, 4, 3
DDP = ShardingConfig(strategy="ddp", dp_replicate=2)
START_LINE = re.compile(r"rank (\d+) of \d+ on host \S+, pid (\d+)")
SLICE_S = 0.005  # how long the workers run between two looks at their progress


def ddp_config(cache: Path, name: str) -> RunConfig:
    cfg = base_config(cache, steps=STEPS, micro_batch=4)  # global batch 8 = 4 x 2 ranks
    return replace(cfg, name=name, sharding=DDP, checkpoint=CheckpointConfig(every=EVERY, keep_last=KEEP))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def reference(root, data_cache) -> Path:
    """The uninterrupted run (checkpoints 8, 12 and 16 kept): the losses every faulty run must reproduce."""
    run_dir = write_run_dir(root, ddp_config(data_cache, "reference"))
    proc = run_worker(run_dir, 2)
    assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n{all_logs(run_dir)[-3000:]}"
    return run_dir


# --- reading what a run left -------------------------------------------------------------------

def all_logs(run_dir: Path) -> str:
    return "\n".join(p.read_text() for p in sorted((run_dir / "logs").glob("rank*.log")))


def final_steps(run_dir: Path) -> dict[int, tuple[float, float]]:
    """step -> (loss, grad_norm) of the last train record of each step."""
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in records(run_dir, "train")}


def last_train_step(run_dir: Path) -> int:
    """The newest train step in metrics.jsonl; only complete lines count (rank 0 may be stopped mid-write)."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    steps = [r["step"] for r in map(json.loads, lines) if r["kind"] == "train"]
    return max(steps, default=0)


def starts(run_dir: Path) -> dict[int, list[int]]:
    """rank -> pids of every attempt that rank was started in, in order (each rank logs one line at start)."""
    found: dict[int, list[int]] = {}
    for match in START_LINE.finditer(all_logs(run_dir)):
        found.setdefault(int(match.group(1)), []).append(int(match.group(2)))
    return found


def first_pids(run_dir: Path) -> list[int] | None:
    """[rank 0's pid, rank 1's pid] of the first attempt, once both ranks have logged their start."""
    found = starts(run_dir)
    return [found[0][0], found[1][0]] if len(found) == 2 else None


def error_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if " ERROR " in line]


def assert_same_losses(run_dir: Path, reference: Path, first: int = 1) -> None:
    """The run's final records of steps first..STEPS equal the reference's, bit for bit, and it logged no others."""
    got, want = final_steps(run_dir), final_steps(reference)
    assert sorted(want) == list(range(1, STEPS + 1))
    want = {step: want[step] for step in range(first, STEPS + 1)}
    steps = want.keys() | got.keys()
    differ = {step: (got.get(step), want.get(step)) for step in steps if got.get(step) != want.get(step)}
    assert got == want, differ


def assert_finished(proc_rc: int, output: str, run_dir: Path) -> None:
    assert proc_rc == 0, f"torchrun exit {proc_rc}:\n{output[-3000:]}\n{all_logs(run_dir)[-4000:]}"
    assert (run_dir / "result.json").is_file()


# --- running torchrun in the background and stopping its workers -------------------------------

def start_torchrun(run_dir: Path, max_restarts: int, fork: bool = False, **env: str) -> tuple[subprocess.Popen, Path]:
    """torchrun --standalone (2 workers, --max-restarts) in the background; output to a file next to the run.

    fork: the ranks forked by trainctl's agent (cluster.rank_start=fork, the cpu default), else each one a new
    interpreter (exec, the cuda default): the cases below take one or the other, so that both ways of starting (and
    restarting) a rank meet a kill."""
    env = worker_env(**TORCHRUN_ENV, **env)
    cmd = torchrun_cmd(2, "-m", "trainctl.train", str(run_dir), max_restarts=max_restarts, fork=fork)
    output = run_dir.with_name(run_dir.name + ".torchrun.out")
    with open(output, "w") as out:  # a file, not a pipe: nobody reads while it runs, a pipe could fill and block it
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True), output


def finish(proc: subprocess.Popen, run_dir: Path, output: Path) -> tuple[int | None, str]:
    """torchrun's exit code (None: it hung and was killed) and output."""
    try:
        rc = proc.wait(timeout=WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        rc = None
        proc.kill()
        proc.wait()
    kill_leftover_workers(run_dir)
    return rc, output.read_text()


def kill_leftover_workers(run_dir: Path) -> None:
    """SIGKILL this run's workers still alive: torchrun starts each in a session of its own (they outlive it)."""
    for pids in starts(run_dir).values():
        for pid in pids:
            try:
                if str(run_dir) in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                    os.kill(pid, signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError):
                pass


def wait_on(condition, proc: subprocess.Popen, what: str):
    """Poll `condition` until it returns something true; fail if torchrun exits or time runs out first."""
    return wait_for(condition, what, WORKER_TIMEOUT_S, proc=proc, interval=0.01)


def process_state(pid: int) -> str:
    """The state letter of /proc/PID/stat (T: stopped); '' once the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return ""
    return stat.rsplit(")", 1)[1].split()[0]


def stop_workers(pids: list[int]) -> None:
    """SIGSTOP every worker and wait until each really is stopped (the signal is delivered asynchronously)."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    for pid in pids:
        while process_state(pid) not in ("T", "t"):
            if process_state(pid) in ("", "Z"):
                pytest.fail(f"worker {pid} exited before the kill: the run ended early")
            time.sleep(0.0005)


def resume_workers(pids: list[int]) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGCONT)


def freeze_after_step(run_dir: Path, pids: list[int], step: int) -> int:
    """Let the workers run in short slices until `step` is logged; returns the last logged step, workers left stopped.

    Checking while they are stopped means the run cannot race to its end between the look and the kill,
    however slowly this process is scheduled.
    """
    while True:
        stop_workers(pids)
        done = last_train_step(run_dir)
        if done >= step:
            assert done < STEPS, f"the run reached its last step ({done}) before the kill"
            return done
        resume_workers(pids)
        time.sleep(SLICE_S)


# --- a. a random worker killed at a random step ------------------------------------------------

# rank 1 after step 11, rank 0 after 6, rank 0 after 12
@pytest.mark.parametrize(("seed", "fork"), [(0, True), (1, False), (6, False)], ids=["0-fork", "1", "6"])
def test_killed_worker_restarts_and_matches(root, data_cache, reference, seed, fork):
    rng = random.Random(seed)
    # After the first checkpoint (step 4), so that the restart must resume from one.
    victim, kill_step = rng.randrange(2), rng.randint(EVERY + 1, STEPS - EVERY)
    run_dir = write_run_dir(root, ddp_config(data_cache, f"kill-seed{seed}"))
    proc, output = start_torchrun(run_dir, max_restarts=2, fork=fork)
    try:
        pids = wait_on(lambda: first_pids(run_dir), proc, "both workers to start")
        killed_after = freeze_after_step(run_dir, pids, kill_step)
        committed_at_kill = [step for step, _ in list_committed(checkpoint_dir(run_dir))]
        os.kill(pids[victim], signal.SIGKILL)
        resume_workers(pids)
    except BaseException:
        proc.kill()  # the workers may be stopped: do not wait for them to finish
        raise
    finally:
        rc, out = finish(proc, run_dir, output)
    assert_finished(rc, out, run_dir)
    assert {rank: len(p) for rank, p in starts(run_dir).items()} == {0: 2, 1: 2}, "torchrun did not restart the workers"
    assert_same_losses(run_dir, reference)
    assert_resumed_from_newest(run_dir, committed_at_kill, killed_after)


def assert_resumed_from_newest(run_dir: Path, committed_at_kill: list[int], killed_after: int) -> None:
    """One restart, from the newest checkpoint committed by the kill (or the next: a surviving rank 0 may still commit
    a save that the victim had finished its part of)."""
    resumes = [r["step"] for r in records(run_dir, "resume")]
    assert len(resumes) == 1 and committed_at_kill, (resumes, committed_at_kill)
    assert resumes[0] % EVERY == 0 and committed_at_kill[-1] <= resumes[0] <= killed_after, \
        (resumes, committed_at_kill, killed_after)


# --- b. a kill during a save -------------------------------------------------------------------

def test_kill_during_save_resumes_from_previous(root, data_cache, reference):
    run_dir = write_run_dir(root, ddp_config(data_cache, "kill-in-save"))
    proc, output = start_torchrun(run_dir, max_restarts=1, **fault_env(die_before_commit=2 * EVERY))
    rc, out = finish(proc, run_dir, output)
    assert_finished(rc, out, run_dir)
    assert [r["step"] for r in records(run_dir, "resume")] == [EVERY]
    # The killed save's step-00000008.tmp was cleared at the restart; the second attempt committed step 8 itself.
    root_dir = checkpoint_dir(run_dir)
    assert not list(root_dir.glob("*.tmp")), sorted(p.name for p in root_dir.iterdir())
    assert [step for step, _ in list_committed(root_dir)] == [8, 12, 16]
    assert "removing" in all_logs(run_dir) and step_name(2 * EVERY) + ".tmp" in all_logs(run_dir)
    assert_same_losses(run_dir, reference)


# --- c. damaged shards -------------------------------------------------------------------------

def copy_of(reference: Path, name: str) -> Path:
    """The finished reference run with its checkpoints, minus its results: what the rerun records is its own."""
    run_dir = reference.with_name(name)
    shutil.copytree(reference, run_dir)
    for result in ("metrics.jsonl", "result.json"):
        (run_dir / result).unlink()
    return run_dir


def alter_one_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


def shard(run_dir: Path, step: int) -> Path:
    return checkpoint_dir(run_dir) / step_name(step) / "__1_0.distcp"


@pytest.mark.parametrize("damage", [truncate, alter_one_byte], ids=["truncated", "altered"])
def test_damaged_newest_falls_back_to_previous(reference, damage):
    run_dir = copy_of(reference, f"damaged-{damage.__name__}")
    damage(shard(run_dir, STEPS))
    assert verify(shard(run_dir, STEPS).parent), "the damage went unnoticed by verify"
    proc = run_worker(run_dir, 2)
    assert_finished(proc.returncode, proc.stderr, run_dir)
    log = (run_dir / "logs" / "rank0.log").read_text()
    damaged = rf"checkpoint \S+{step_name(STEPS)} is damaged, falling back to an older one: __1_0.distcp"
    assert re.search(damaged, log), log[-3000:]
    assert [r["step"] for r in records(run_dir, "resume")] == [STEPS - EVERY]
    assert_same_losses(run_dir, reference, first=STEPS - EVERY + 1)
    assert verify(shard(run_dir, STEPS).parent) == []  # the rerun wrote step 16 again, whole


def test_every_checkpoint_damaged_is_one_clear_error(reference):
    run_dir = copy_of(reference, "all-damaged")
    for step, _ in list_committed(checkpoint_dir(run_dir)):
        truncate(shard(run_dir, step))
    proc = run_worker(run_dir, 2)
    assert proc.returncode != 0
    errors = error_lines((run_dir / "logs" / "rank0.log").read_text())
    assert len(errors) == 1, errors
    none_valid = r"no valid checkpoint under \S+: all 3 committed checkpoints fail verification"
    assert re.search(none_valid, errors[0]), errors[0]
    assert "Traceback" not in all_logs(run_dir)


def test_restart_after_the_final_checkpoint_just_finishes(reference):
    # A crash (or preemption) after the final checkpoint committed but before result.json: the
    # restart has no step left to run; it writes the result the finished run would have written.
    run_dir = reference.with_name("after-final")
    shutil.copytree(reference, run_dir)
    (run_dir / "result.json").unlink()
    trained = records(run_dir, "train")
    proc = run_worker(run_dir, 2)
    assert_finished(proc.returncode, proc.stderr, run_dir)
    assert records(run_dir, "train") == trained  # no step ran again
    assert [r["step"] for r in records(run_dir, "resume")] == [STEPS]
    got, want = (json.loads((d / "result.json").read_text()) for d in (run_dir, reference))
    assert got["resumed_from_step"] == STEPS and got["steps"] == STEPS and not got["stopped"]
    for key in ("final_train_loss", "final_grad_norm", "final_val_loss", "initial_val_loss", "tokens_seen"):
        assert got[key] == want[key], key


# --- d. a full disk ----------------------------------------------------------------------------

def checkpoint_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_full_disk_is_one_clear_error_and_keeps_previous(root, data_cache, reference):
    size = checkpoint_bytes(checkpoint_dir(reference) / step_name(STEPS))
    run_dir = write_run_dir(root, ddp_config(data_cache, "full-disk"))
    mount_point = checkpoint_dir(run_dir)
    mount_point.mkdir()
    # Room for one checkpoint and half of another: step 4 commits, step 8 runs out (pruning comes after a commit).
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size * 3 // 2}", "tmpfs", str(mount_point)], check=True)
    try:
        proc = run_worker(run_dir, 2)
        committed = list_committed(mount_point)
        problems = [verify(path) for _, path in committed]
        leftovers = sorted(p.name for p in mount_point.iterdir() if p.name.endswith(".tmp"))
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)
    assert proc.returncode != 0
    errors = error_lines((run_dir / "logs" / "rank0.log").read_text())
    assert len(errors) == 1, errors
    assert f"checkpoint step {2 * EVERY}: disk full under {mount_point}" in errors[0], errors[0]
    assert f"the previous checkpoint {step_name(EVERY)} is intact" in errors[0], errors[0]
    assert "Traceback" not in all_logs(run_dir)
    assert [step for step, _ in committed] == [EVERY] and problems == [[]], (committed, problems)
    assert leftovers == []
    assert not (run_dir / "result.json").exists()
