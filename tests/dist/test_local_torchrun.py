"""local.run with a real torchrun on CPU: rank-0 streaming, failure summary parsing, Ctrl-C."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import wait_for
from trainctl.config.schema import ClusterConfig
from trainctl.launch.backends.local import launcher as local
from trainctl.launch.command import shell_join

pytestmark = pytest.mark.dist

WORKER = """\
import os, sys, time
from pathlib import Path
rank = int(os.environ["RANK"])
print(f"hello from rank {rank}", flush=True)
Path(sys.argv[1], f"started{rank}").touch()
time.sleep(float(os.environ.get("TEST_HOLD_S", "0.5")))
if rank == int(os.environ.get("TEST_FAIL_RANK", "-1")):
    print(f"rank {rank} gives up", file=sys.stderr, flush=True)
    sys.exit(3)
time.sleep(float(os.environ.get("TEST_HOLD_S", "0.5")))
"""


def make_run_dir(tmp_path: Path, env: str) -> Path:
    """A run dir whose launch.sh is the real torchrun line, pointed at a tiny worker script instead of trainctl.train."""
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    # Plain torchrun (exec): the agent of cluster.rank_start=fork starts trainctl's worker only.
    argv = local.local_argv(ClusterConfig(procs_per_node=2, rank_start="exec"), run_dir)
    assert argv[-3:-1] == ["-m", "trainctl.train"]
    argv = [*argv[:-3], str(worker), str(tmp_path)]
    (run_dir / "launch.sh").write_text(f"#!/usr/bin/env bash\n{textwrap.dedent(env)}export PYTHONUNBUFFERED=1\nexec {shell_join(argv)}\n")
    return run_dir


def test_failed_rank_is_reported_with_its_captured_stderr(tmp_path, capsys):
    run_dir = make_run_dir(tmp_path, "export TEST_FAIL_RANK=1\n")
    sink = io.BytesIO()
    code = local.run(run_dir, out=sink)
    assert code != 0
    shown = sink.getvalue().decode()
    assert "hello from rank 0" in shown and "hello from rank 1" not in shown  # only rank 0 on the console
    err = capsys.readouterr().err
    assert "rank 1 failed" in err and "exit code 3" in err
    log = Path(err.split("log: ")[1].strip())
    assert "rank 1 gives up" in log.read_text()


def test_ctrl_c_stops_torchrun_and_its_workers(tmp_path):
    run_dir = make_run_dir(tmp_path, "export TEST_HOLD_S=60\n")
    runner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import sys; from pathlib import Path; from trainctl.launch.backends.local import launcher as local; sys.exit(local.run(Path({str(run_dir)!r})))",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(lambda: all((tmp_path / f"started{r}").exists() for r in (0, 1)), "both workers to start",
                 timeout=60, proc=runner, interval=0.1)
        runner.send_signal(signal.SIGINT)
        runner.communicate(timeout=60)
    finally:
        if runner.poll() is None:
            runner.kill()
    assert runner.returncode != 0
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path / "worker.py")], capture_output=True, text=True).stdout.split()
    assert [pid for pid in leftover if int(pid) != os.getpid()] == []
