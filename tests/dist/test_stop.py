"""Stopping is saving, and a failure names its first rank: real torchrun, 2 gloo workers, real signals.

torchrun is started directly (no CLI), with the launcher's output arguments (logs and error files under
RUN_DIR/logs/torchrun) and environment. A test entry script wraps the worker: it records each rank's exit
code, and can pace the steps (so a signal lands mid-run), slow the stop's save (so a second signal lands
during it) or raise a DataError on rank 0 alone.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest
from worker_runs import WORKER_TIMEOUT_S, base_config, records, write_run_dir

from tests.helpers import torchrun_cmd, wait_for, worker_env
from trainctl.config.schema import CheckpointConfig, RunConfig, ShardingConfig
from trainctl.core import rundir
from trainctl.core.checkpoints import checkpoint_dir, list_committed, step_name, verify
from trainctl.launch.backends.local.failure import first_failure
from trainctl.launch.command import TORCHRUN_ENV, output_args

pytestmark = pytest.mark.dist

STEPS = 24
DDP = ShardingConfig(strategy="ddp", dp_replicate=2)

ENTRY = '''\
import os, sys, time
from pathlib import Path

run_dir, rank, mode = Path(sys.argv[1]), int(os.environ.get("RANK", 0)), os.environ.get("TEST_MODE", "")
from trainctl.train.loop import trainer
from trainctl.train.loop.data import TokenBatches
from trainctl.train.loop.sources import DataError

if mode in ("pace", "slow_save"):  # a step takes TEST_PACE_S more (50 ms): a signal lands mid-run
    tick, pace = trainer.StepTimer.tick, float(os.environ.get("TEST_PACE_S", "0.05"))
    def paced(self):
        time.sleep(pace)
        tick(self)
    trainer.StepTimer.tick = paced
if mode == "slow_save":  # the stop's save waits: a second signal lands during it
    save = trainer.save_checkpoint
    def slow(job, step, *args):
        if job.stop.requested:
            Path(run_dir, f"saving{rank}").touch()
            time.sleep(120)
        save(job, step, *args)
    trainer.save_checkpoint = slow
if mode == "data_error":  # rank 0 alone finds bad data at step 3; rank 1 then loses its peer
    batches = TokenBatches.micro_batches
    def bad(self, step):
        if rank == 0 and step == 3:
            raise DataError("data.train_path='/data/x.bin': token id 300 >= data.vocab_size=256; set it to > 300")
        return batches(self, step)
    TokenBatches.micro_batches = bad

from trainctl.train.__main__ import main
code = main([str(run_dir)])
Path(run_dir, f"exit-rank{rank}").write_text(str(code))
sys.exit(code)
'''


def config(cache: Path, name: str) -> RunConfig:
    cfg = base_config(cache, steps=STEPS, micro_batch=4)  # global batch 8 = 4 x 2 ranks
    return replace(cfg, name=name, sharding=DDP, checkpoint=CheckpointConfig(every=0))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("stop")
    (root / "entry.py").write_text(ENTRY)
    return root


class Torchrun:
    """torchrun --standalone with 2 workers in the background, output to a file (a pipe could fill and block it)."""

    def __init__(self, root: Path, run_dir: Path, mode: str = "", **env: str):
        env = worker_env(**TORCHRUN_ENV, TEST_MODE=mode, **env)
        cmd = torchrun_cmd(2, str(root / "entry.py"), str(run_dir), max_restarts=0, args=tuple(output_args(run_dir)))
        self.run_dir, self.output = run_dir, run_dir.with_name(run_dir.name + ".torchrun.out")
        with open(self.output, "w") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_for(self, condition, what: str, timeout: float = WORKER_TIMEOUT_S):
        """Poll `condition`; fail, with the tail of torchrun's output, if torchrun exits or time runs out first."""
        return wait_for(condition, what, timeout, proc=self.proc, report=lambda: self.text()[-3000:])

    def finish(self, timeout: float = WORKER_TIMEOUT_S) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            for pid in worker_pids(self.run_dir):
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)

    def text(self) -> str:
        return self.output.read_text(errors="replace")


def worker_pids(run_dir: Path) -> list[int]:
    logs = (run_dir / "logs").glob("rank*.log")
    return [int(line.rsplit("pid ", 1)[1]) for p in logs for line in p.read_text().splitlines() if " on host " in line]


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def last_train_step(run_dir: Path) -> int:
    steps = [rundir.as_int(r.get("step"), 0) for r in rundir.metrics(run_dir) if r.get("kind") == "train"]
    return max(steps, default=0)


def exit_codes(run_dir: Path) -> dict[int, int]:
    files = {rank: run_dir / f"exit-rank{rank}" for rank in (0, 1)}
    return {rank: int(path.read_text()) for rank, path in files.items() if path.exists()}


def worker_output(run_dir: Path) -> str:
    """Every rank's log and what torchrun captured of every worker's stdout and stderr."""
    files = [*(run_dir / "logs").glob("rank*.log"), *(run_dir / rundir.TORCHRUN_LOGS).glob("*/attempt_*/*/std*.log")]
    return "\n".join(p.read_text(errors="replace") for p in files)


def losses(run_dir: Path) -> dict[int, tuple[float, float]]:
    """step -> (loss, grad norm); every train step must appear once."""
    train = records(run_dir, "train")
    steps = [r["step"] for r in train]
    assert len(steps) == len(set(steps)), f"steps logged twice: {sorted(s for s in steps if steps.count(s) > 1)}"
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in train}


@pytest.fixture(scope="module")
def reference(root, data_cache) -> Path:
    run_dir = write_run_dir(root, config(data_cache, "reference"))
    run = Torchrun(root, run_dir)
    assert run.finish() == 0, run.text()[-3000:]
    return run_dir


def test_sigint_saves_at_the_step_and_the_resume_matches_bitwise(root, data_cache, reference):
    stop_after = random.Random(11).randint(4, STEPS - 8)
    run_dir = write_run_dir(root, config(data_cache, "sigint"))
    run = Torchrun(root, run_dir, mode="pace")
    try:
        run.wait_for(lambda: last_train_step(run_dir) >= stop_after, f"step {stop_after}")
        run.proc.send_signal(signal.SIGINT)  # what the launcher forwards on Ctrl-C
        rc = run.finish(timeout=60)
    finally:
        run.finish(timeout=1)
    assert rc not in (None, 0), "torchrun should end nonzero on a signal"
    assert exit_codes(run_dir) == {0: 130, 1: 130}, run.text()[-3000:]
    stop = rundir.stop_record(run_dir)
    stopped_at = stop["step"]
    assert stop["signal"] == "SIGINT" and stopped_at >= stop_after and stop["checkpoint"] == step_name(stopped_at), stop
    assert [s for s, _ in list_committed(checkpoint_dir(run_dir))] == [stopped_at]  # checkpoint.every=0
    assert verify(checkpoint_dir(run_dir) / step_name(stopped_at)) == []
    assert last_train_step(run_dir) == stopped_at and not (run_dir / rundir.RESULT).exists()
    assert rundir.hang_files(run_dir) == []  # a stop is never a hang: each rank cancelled its watchdog, removed its file
    output = worker_output(run_dir) + run.text()
    assert "Traceback" not in worker_output(run_dir)
    assert f"stopped by SIGINT after step {stopped_at}: checkpoint {step_name(stopped_at)} committed; " \
           f"continue with `trainctl resume sigint`" in output

    # An earlier attempt may have logged past its checkpoint (killed after it): the resume drops those records.
    with open(run_dir / rundir.METRICS, "a") as f:
        f.write(json.dumps({"kind": "train", "step": stopped_at + 1, "loss": 0.0, "grad_norm": 0.0}) + "\n{half a li")
    again = Torchrun(root, run_dir)
    assert again.finish() == 0, again.text()[-3000:]
    assert exit_codes(run_dir) == {0: 0, 1: 0}
    assert not (run_dir / rundir.STOPPED).exists()  # the new attempt cleared the stop record
    assert [r["step"] for r in records(run_dir, "resume")] == [stopped_at]
    assert losses(run_dir) == losses(reference)  # each step once, bitwise equal to the uninterrupted run


def test_second_sigint_stops_at_once_without_a_checkpoint(root, data_cache):
    run_dir = write_run_dir(root, config(data_cache, "twice"))
    run = Torchrun(root, run_dir, mode="slow_save")
    try:
        run.wait_for(lambda: last_train_step(run_dir) >= 3, "step 3")
        pids = worker_pids(run_dir)
        run.proc.send_signal(signal.SIGINT)
        run.wait_for(lambda: all((run_dir / f"saving{r}").exists() for r in (0, 1)), "the stop's save")
        time.sleep(2.5)  # past the window in which a repeat counts as the same signal delivered twice
        started = time.monotonic()
        for pid in pids:
            os.kill(pid, signal.SIGINT)
        run.wait_for(lambda: not any(alive(pid) for pid in pids) or None, "the workers to exit", timeout=10)
        took = time.monotonic() - started
        rc = run.finish(timeout=30)
    finally:
        run.finish(timeout=1)
    assert took < 5 and rc is not None
    assert list_committed(checkpoint_dir(run_dir)) == [] and not list(checkpoint_dir(run_dir).glob("*"))
    assert not (run_dir / rundir.STOPPED).exists()
    for rank in (0, 1):
        log = (run_dir / "logs" / f"rank{rank}.log").read_text()
        assert "SIGINT received (second stop signal: no checkpoint): exiting now" in log, log[-3000:]
    assert "Traceback" not in worker_output(run_dir)


def test_sigterm_saves_and_exits_143(root, data_cache):
    run_dir = write_run_dir(root, config(data_cache, "sigterm"))
    run = Torchrun(root, run_dir, mode="pace")
    try:
        run.wait_for(lambda: last_train_step(run_dir) >= 2, "step 2")
        run.proc.send_signal(signal.SIGTERM)  # what `trainctl cancel` sends
        run.finish(timeout=60)
    finally:
        run.finish(timeout=1)
    assert exit_codes(run_dir) == {0: 143, 1: 143}, run.text()[-3000:]
    stop = rundir.stop_record(run_dir)
    assert stop["signal"] == "SIGTERM"
    assert rundir.hang_files(run_dir) == []
    assert [s for s, _ in list_committed(checkpoint_dir(run_dir))] == [stop["step"]]
    assert "Traceback" not in worker_output(run_dir)


def test_workers_die_with_a_killed_torchrun(root, data_cache):
    run_dir = write_run_dir(root, config(data_cache, "orphans"))
    run = Torchrun(root, run_dir, mode="pace", TEST_PACE_S="1")  # 20 s left to train when torchrun is killed
    try:
        run.wait_for(lambda: last_train_step(run_dir) >= 2, "step 2")
        pids = worker_pids(run_dir)
        assert len(pids) == 2 and all(map(alive, pids))
        os.kill(run.proc.pid, signal.SIGKILL)  # torchrun alone: the workers are in sessions of their own
        wait_for(lambda: not any(map(alive, pids)), "the workers to die with their torchrun", timeout=5,
                 report=lambda: f"alive: {[pid for pid in pids if alive(pid)]}")
    finally:
        run.finish(timeout=5)


def test_data_error_on_rank0_is_the_first_failure(root, data_cache):
    run_dir = write_run_dir(root, config(data_cache, "bad-data"))
    run = Torchrun(root, run_dir, mode="data_error")
    rc = run.finish()
    assert rc not in (None, 0)
    failure = first_failure(run_dir)
    assert failure is not None, run.text()[-3000:]
    assert (failure.rank, failure.exit_code) == (0, 2), failure
    assert failure.message == "data.train_path='/data/x.bin': token id 300 >= data.vocab_size=256; set it to > 300"
    assert failure.log == str(run_dir / "logs" / "rank0.log")
    errors = sorted((run_dir / rundir.TORCHRUN_LOGS).glob("*/attempt_0/*/error.json"))
    contents = [json.loads(p.read_text()) for p in errors]
    messages = {data["trainctl"]["rank"]: data["message"]["message"] for data in contents}
    assert 0 in messages and (1 not in messages or messages[1] != messages[0]), messages
    # One line per failing rank on what the console shows of it (torchrun's capture), never a traceback;
    # an unexpected error's traceback once, in the rank's own log.
    stderr_logs = (run_dir / rundir.TORCHRUN_LOGS).glob("*/attempt_0/*/stderr.log")
    captured = {int(p.parent.name): p.read_text() for p in stderr_logs}
    assert "Traceback" not in "".join(captured.values())
    assert captured[0].count("ERROR: ") == 1 and failure.message in captured[0]
    assert "Traceback" not in (run_dir / "logs" / "rank0.log").read_text()
    if 1 in messages:  # rank 1 lost its peer before torchrun stopped it
        assert captured[1].count("ERROR: training failed: RuntimeError") == 1, captured[1]
        assert (run_dir / "logs" / "rank1.log").read_text().count("Traceback") == 1
    assert failure.message in run.text()  # torchrun's summary shows the line too
