"""One trainer per run directory, relocatable runs, and stopping that saves: real `trainctl` processes, real torchrun.

Each test starts real launches of a tiny model on 2 CPU workers and attacks them the way a careless user would:
a second launch on the same directory, two resumes at once, a copied or moved run, Ctrl-C.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from worker_runs import TINY_OVERRIDES

from tests.helpers import cli_env, run_cli, start_cli, wait_for
from trainctl.core.checkpoints import list_committed, verify

pytestmark = pytest.mark.dist

SMALL = [
    "recipe=tiny_cpu",
    *TINY_OVERRIDES,
    "train.eval_batches=2",
    "schedule.warmup_steps=3",
    "logging.log_every=1",
    "logging.progress=false",
]


def trainctl(cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_cli(*args, cwd=cwd, timeout=timeout)


def start(cwd: Path, *args: str) -> subprocess.Popen:
    return start_cli(*args, cwd=cwd)


def train_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["step"] for r in records if r.get("kind") == "train"]


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in records if r.get("kind") == "train"}


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def run_state(cwd: Path, name: str) -> dict:
    proc = trainctl(cwd, "runs", timeout=60)
    assert proc.returncode == 0, proc.stderr
    row = next(line for line in proc.stdout.splitlines() if line.split() and line.split()[0] == name)
    return {"state": row.split()[3], "row": row}


@pytest.fixture
def workdir(tmp_path, data_cache) -> Path:
    (tmp_path / "work").mkdir()
    return tmp_path / "work"


def cache(data_cache: Path) -> str:
    return f"data.cache_dir={data_cache}"


def test_a_second_trainer_is_refused_before_it_touches_anything(workdir, data_cache):
    first = start(workdir, "launch", *SMALL, cache(data_cache), "train.steps=400", "checkpoint.every=5", "--name", "x")
    run_dir = workdir / "runs" / "x"
    try:
        wait_for(lambda: len(list_committed(run_dir / "checkpoints")) >= 1, "a committed checkpoint", proc=first)
        records = {name: (run_dir / name).read_bytes() for name in ("launch.json", "trainer.json")}
        # The README's relaunch, while the launch trains: refused in one line naming the holder, exit 2.
        again = subprocess.run(["bash", str(run_dir / "launch.sh")], cwd=workdir, env=cli_env(), capture_output=True,
                               text=True, timeout=60)
        assert again.returncode == 2, again.stderr
        assert "is being trained by pid" in again.stderr and "Traceback" not in again.stderr
        resumed = trainctl(workdir, "resume", "x", timeout=60)
        assert resumed.returncode == 2 and "still RUNNING" in resumed.stderr and "Traceback" not in resumed.stderr
        # The refused ones wrote nothing, and the running trainer keeps going.
        assert {name: (run_dir / name).read_bytes() for name in records} == records
        steps_now = max(train_steps(run_dir))
        wait_for(lambda: max(train_steps(run_dir)) > steps_now + 3, "three more steps", proc=first)
        cancelled = trainctl(workdir, "cancel", "x", timeout=60)
        assert cancelled.returncode == 0, cancelled.stderr
        code, _, err = finish(first)
    finally:
        if first.poll() is None:
            first.kill()
    assert code == 143, err[-3000:]
    assert "Traceback" not in err
    committed = list_committed(run_dir / "checkpoints")
    assert committed and all(verify(path) == [] for _, path in committed)
    steps = train_steps(run_dir)
    assert len(steps) == len(set(steps)), "every step logged once"
    assert run_state(workdir, "x")["state"] == "CANCELLED"


def interrupted(workdir: Path, data_cache: Path, name: str, steps: int, after: int, sig: int) -> tuple[int, str]:
    """Launch `name` with `checkpoint.every=0`, send `sig` to the launcher after `after` steps; (exit code, stderr)."""
    proc = start(workdir, "launch", *SMALL, cache(data_cache), f"train.steps={steps}", "checkpoint.every=0", "--name", name)
    run_dir = workdir / "runs" / name
    try:
        wait_for(lambda: len(train_steps(run_dir)) >= after, f"{after} training steps", proc=proc)
        proc.send_signal(sig)
        code, _, err = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    return code, err


def stopped_run(workdir: Path, data_cache: Path, name: str, steps: int = 12, stop_after: int = 6) -> Path:
    """A run stopped (SIGTERM to its launcher: the worker saves) after `stop_after` steps of `steps`."""
    code, err = interrupted(workdir, data_cache, name, steps, stop_after, signal.SIGTERM)
    run_dir = workdir / "runs" / name
    assert code == 143, err[-3000:]
    assert list_committed(run_dir / "checkpoints"), "the stop saved a checkpoint"
    return run_dir


def test_two_resumes_at_once_one_trains_the_other_is_refused(workdir, data_cache):
    run_dir = stopped_run(workdir, data_cache, "twice", steps=40)
    a, b = start(workdir, "resume", "twice"), start(workdir, "resume", "twice")
    (code_a, _, err_a), (code_b, _, err_b) = finish(a), finish(b)
    assert sorted([code_a, code_b]) == [0, 2], (err_a[-3000:], err_b[-3000:])
    refused = err_a if code_a == 2 else err_b
    assert "is being trained by" in refused or "still RUNNING" in refused
    assert "Traceback" not in refused
    assert (run_dir / "result.json").is_file()
    steps = sorted(losses(run_dir))
    assert steps == list(range(1, 41)), "each step once, none missing"


def test_a_copied_run_resumes_where_it_is_and_never_touches_the_original(workdir, data_cache):
    original = stopped_run(workdir, data_cache, "orig")
    before = snapshot(original)
    copy = workdir / "runs" / "copy"
    shutil.copytree(original, copy)
    proc = trainctl(workdir, "resume", "copy")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (copy / "result.json").is_file() and not (original / "result.json").exists()
    assert snapshot(original) == before, "the original run directory was written"
    # Run again by hand from the copy's own script: it knows where it is (and has nothing left to train).
    moved = workdir / "elsewhere" / "moved"
    moved.parent.mkdir()
    shutil.move(str(original), moved)
    proc = trainctl(workdir, "resume", str(moved))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (moved / "result.json").is_file()
    assert not original.exists(), "the old location was recreated"


def test_ctrl_c_at_a_random_step_saves_and_resume_is_bitwise_the_uninterrupted_run(workdir, data_cache):
    steps = 100  # the stop reaches the workers a few hundred ms (tens of 10 ms steps) after the signal
    reference = trainctl(workdir, "launch", *SMALL, cache(data_cache), f"train.steps={steps}", "checkpoint.every=0",
                         "--name", "reference")
    assert reference.returncode == 0, reference.stderr[-3000:]
    stop_at = random.Random(11).randint(3, 30)
    # SIGINT: what the terminal sends the launcher on Ctrl-C.
    code, err = interrupted(workdir, data_cache, "ctrlc", steps, stop_at, signal.SIGINT)
    run_dir = workdir / "runs" / "ctrlc"
    assert code == 130, err[-3000:]
    assert "Traceback" not in err
    assert "trainctl resume" in err
    assert run_state(workdir, "ctrlc")["state"] == "CANCELLED"
    (saved, _), = list_committed(run_dir / "checkpoints")[-1:]
    assert saved >= stop_at
    resumed = trainctl(workdir, "resume", "ctrlc")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got, want = losses(run_dir), losses(workdir / "runs" / "reference")
    assert sorted(got) == list(range(1, steps + 1))
    assert got == want, "the resumed losses differ from the uninterrupted run's"


def test_a_second_ctrl_c_stops_at_once_without_saving(workdir, data_cache):
    proc = start(workdir, "launch", *SMALL, cache(data_cache), "train.steps=100000", "checkpoint.every=0", "--name", "twice")
    run_dir = workdir / "runs" / "twice"
    try:
        wait_for(lambda: len(train_steps(run_dir)) >= 2, "2 training steps", proc=proc)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)  # two signals sent at once would merge into one pending signal
        proc.send_signal(signal.SIGINT)
        code, _, err = finish(proc, timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code != 0 and "second stop signal" in err, err[-3000:]
    assert "Traceback" not in err
    # Nothing of the run is left running: torchrun was killed, and its workers died with it.
    wait_for(lambda: not processes_naming(run_dir), "every process of the run to exit", timeout=20,
             report=lambda: "\n".join(processes_naming(run_dir)))
    assert run_state(workdir, "twice")["state"] != "RUNNING"


def processes_naming(run_dir: Path) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if proc.name.isdigit() and str(run_dir) in cmdline:
            found.append(f"{proc.name}: {cmdline}")
    return found


def test_a_run_whose_launcher_was_killed_can_still_be_cancelled_and_saves(workdir, data_cache):
    proc = start(workdir, "launch", *SMALL, cache(data_cache), "train.steps=100000", "checkpoint.every=0", "--name", "orphan")
    run_dir = workdir / "runs" / "orphan"
    try:
        wait_for(lambda: len(train_steps(run_dir)) >= 3, "3 training steps", proc=proc)
        proc.kill()  # the launcher dies; torchrun (its own session) trains on and keeps the lock
        proc.wait()
        assert run_state(workdir, "orphan")["state"] == "RUNNING"
        cancelled = trainctl(workdir, "cancel", "orphan", timeout=60)
        assert cancelled.returncode == 0, cancelled.stderr
        wait_for(lambda: run_state(workdir, "orphan")["state"] == "CANCELLED", "the state CANCELLED", timeout=60)
    finally:
        for line in processes_naming(run_dir):
            os.kill(int(line.split(":")[0]), signal.SIGKILL)
    committed = list_committed(run_dir / "checkpoints")
    assert committed and verify(committed[-1][1]) == []
