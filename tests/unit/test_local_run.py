"""local.run against fake launch scripts: exit codes, streaming, failure report, signals."""

from __future__ import annotations

import io
import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from tests.helpers import wait_for
from trainctl.config.schema import ClusterConfig
from trainctl.launch.backends.local import launcher as local

pytestmark = pytest.mark.cli

# The tail of a real torchrun failure (torch 2.13), rank 1 failing first with exit code 3.
TORCHRUN_SUMMARY = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
trainctl.train FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-21_19:46:26
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 3774)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 3774
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-21_19:46:25
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 3 (pid: 3775)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def make_run_dir(tmp_path: Path, body: str) -> Path:
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "launch.sh").write_text("#!/usr/bin/env bash\n" + textwrap.dedent(body))
    return run_dir


def test_exit_code_passes_through_and_is_recorded(tmp_path):
    run_dir = make_run_dir(tmp_path, "echo working\nexit 3\n")
    assert local.run(run_dir, out=io.BytesIO()) == 3
    record = json.loads((run_dir / "launch.json").read_text())
    assert record["exit_code"] == 3
    assert record["start"] <= record["end"]


def test_success_returns_zero_and_reports_nothing(tmp_path, capsys):
    run_dir = make_run_dir(tmp_path, "echo fine\n")
    assert local.run(run_dir, out=io.BytesIO()) == 0
    assert capsys.readouterr().err == ""
    assert "failure" not in json.loads((run_dir / "launch.json").read_text())


class SignallingSink(io.BytesIO):
    """Creates `flag` as soon as `needle` arrives, so the child can tell it was streamed live."""

    def __init__(self, needle: bytes, flag: Path):
        super().__init__()
        self.needle, self.flag = needle, flag

    def write(self, data):
        n = super().write(data)
        if self.needle in self.getvalue():
            self.flag.touch()
        return n


def test_output_is_streamed_while_the_child_runs(tmp_path):
    flag = tmp_path / "seen"
    # The child waits until its first line has reached the sink; buffered until exit it would give up and exit 1.
    run_dir = make_run_dir(
        tmp_path,
        f"""\
        echo first line
        for i in $(seq 100); do [ -e {flag} ] && break; sleep 0.1; done
        [ -e {flag} ] || exit 1
        echo second line
        """,
    )
    sink = SignallingSink(b"first line", flag)
    assert local.run(run_dir, out=sink) == 0
    assert sink.getvalue() == b"first line\nsecond line\n"


def test_failure_report_names_the_rank_and_its_log(tmp_path, capsys):
    run_dir = make_run_dir(tmp_path, f"cat <<'EOF'\n{TORCHRUN_SUMMARY}EOF\nexit 1\n")
    (run_dir / "logs" / "rank1.log").write_text("boom\n")
    assert local.run(run_dir, out=io.BytesIO()) == 1
    err = capsys.readouterr().err
    assert "rank 1 failed" in err and "exit code 3" in err
    assert str(run_dir / "logs" / "rank1.log") in err
    failure = json.loads((run_dir / "launch.json").read_text())["failure"]
    assert (failure["rank"], failure["exit_code"]) == (1, 3)


def test_failure_report_falls_back_to_torchrun_captured_stderr(tmp_path, capsys):
    run_dir = make_run_dir(tmp_path, f"cat <<'EOF'\n{TORCHRUN_SUMMARY}EOF\nexit 1\n")
    captured = run_dir / "logs" / "torchrun" / "abc_123" / "attempt_0" / "1" / "stderr.log"
    captured.parent.mkdir(parents=True)
    captured.write_text("Traceback ...\n")
    local.run(run_dir, out=io.BytesIO())
    assert str(captured) in capsys.readouterr().err


def test_failure_without_summary_points_at_the_logs(tmp_path, capsys):
    run_dir = make_run_dir(tmp_path, "exit 7\n")
    assert local.run(run_dir, out=io.BytesIO()) == 7
    err = capsys.readouterr().err
    assert "exit code 7" in err and str(run_dir / "logs") in err


RUNNER = """\
import sys
from dataclasses import replace
from pathlib import Path
from trainctl.launch.backends.local import launcher as local
sys.exit(local.run(Path(sys.argv[1])))
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie waiting for its parent to reap it is dead for our purpose.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_stops_the_whole_child_group(tmp_path, sig):
    pid_file = tmp_path / "grandchild.pid"
    # As launch.sh execs torchrun, which runs workers: the script execs a Python parent of a grandchild; both must
    # stop. (A bash parent instead would race: bash may see its child die first and carry on to exit 0.)
    # Both restore SIGINT's default action: a test run in the background inherits it ignored (as bash sets it
    # for asynchronous commands), which torchrun and its workers would not be started with.
    grandchild = (f"import os, signal, time; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                  f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)")
    parent = (f"import os, signal, subprocess, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
              f"open({str(tmp_path / 'child.pid')!r}, 'w').write(str(os.getpid())); "
              f"subprocess.Popen([sys.executable, '-c', {grandchild!r}]).wait(); print('not reached')")
    run_dir = make_run_dir(tmp_path, f"exec {shlex.quote(sys.executable)} -c {shlex.quote(parent)}\n")
    runner = subprocess.Popen([sys.executable, "-c", RUNNER, str(run_dir)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    try:
        wait_for(lambda: pid_file.exists() and pid_file.read_text().strip() != "", "the grandchild's pid", proc=runner)
        child, grandchild = int((tmp_path / "child.pid").read_text()), int(pid_file.read_text())
        runner.send_signal(sig)
        out, _ = runner.communicate(timeout=60)  # generous: a loaded CI machine starts Python slowly
    finally:
        if runner.poll() is None:
            runner.kill()
    assert runner.returncode == 128 + sig  # the child died of the forwarded signal
    assert b"not reached" not in out
    wait_for(lambda: not alive(grandchild), "the grandchild to exit")
    assert not alive(child)
    assert json.loads((run_dir / "launch.json").read_text())["exit_code"] == 128 + sig


def test_rendered_script_execs_torchrun_on_this_machine(tmp_path):
    cluster = ClusterConfig(procs_per_node=2, cpu_threads=3, max_restarts=1)
    script = local.render_script(cluster, tmp_path / "run", workdir=tmp_path)
    lines = script.splitlines()
    assert f"cd {tmp_path}" in lines
    assert "export OMP_NUM_THREADS=3" in lines
    exec_line = next(line for line in lines if line.startswith("exec "))
    # On cpu the ranks are forked by torchrun's agent after one import (cluster.rank_start=auto: train/agent.py).
    for arg in ("-m trainctl.train.agent", "--standalone", "--nproc_per_node=2", "--max_restarts=1",
                "--local-ranks-filter=0"):
        assert arg in exec_line
    # The run directory is where the script is (a copied or moved run trains where it now is).
    assert exec_line.endswith('-m trainctl.train "${RUN_DIR}"')
    assert '"--log-dir=${RUN_DIR}/logs/torchrun"' in exec_line
    assert str(tmp_path / "run") not in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


@pytest.mark.parametrize(("device", "rank_start", "module"), [
    ("cpu", "auto", "trainctl.train.agent"), ("cuda", "auto", "torch.distributed.run"),
    ("cpu", "exec", "torch.distributed.run"), ("cuda", "fork", "trainctl.train.agent")])
def test_rank_start_picks_plain_torchrun_or_its_forking_agent_with_the_same_arguments(tmp_path, device, rank_start,
                                                                                      module):
    cluster = ClusterConfig(procs_per_node=2, device=device, rank_start=rank_start)
    exec_line = next(line for line in local.render_script(cluster, tmp_path / "run").splitlines()
                     if line.startswith("exec "))
    words = shlex.split(exec_line)
    assert words[2:4] == ["-m", module]
    plain = shlex.split(next(line for line in local.render_script(replace(cluster, rank_start="exec"),
                                                                   tmp_path / "run").splitlines()
                             if line.startswith("exec ")))
    assert words[4:] == plain[4:]  # torchrun's own options and the worker, unchanged


def test_rendered_script_shares_cores_between_workers_by_default(tmp_path):
    script = local.render_script(ClusterConfig(procs_per_node=2), tmp_path / "run", workdir=tmp_path)
    omp_line = next(line for line in script.splitlines() if "OMP_NUM_THREADS" in line)
    done = subprocess.run(["bash", "-c", f"unset OMP_NUM_THREADS; {omp_line}; echo $OMP_NUM_THREADS"],
                          capture_output=True, text=True)
    assert int(done.stdout) == max(1, len(os.sched_getaffinity(0)) // 2)  # (nproc would report OMP_NUM_THREADS)


def test_torchruns_own_traceback_stays_off_the_console_but_in_the_launcher_log(tmp_path, capsys):
    trace = "Traceback (most recent call last):\n  File \"run.py\", line 1\nChildFailedError:\n"
    body = (f"echo '[default0]:step 1 loss 2.0'\necho 'E1123 17:54:19.123000 1 api.py:882] failed (exitcode: 1)'\n"
            f"cat <<'EOF'\n{trace}{TORCHRUN_SUMMARY}EOF\nexit 1\n")
    run_dir = make_run_dir(tmp_path, body)
    sink = io.BytesIO()
    assert local.run(run_dir, out=sink) == 1
    shown = sink.getvalue().decode()
    assert shown == "step 1 loss 2.0\n"  # the one rank shown needs no prefix (the log keeps it)
    logged = (run_dir / "logs" / "launcher.log").read_text()
    assert "Traceback" in logged and "Root Cause" in logged and "[default0]:step 1" in logged
    assert "rank 1 failed first" in capsys.readouterr().err


def test_a_run_that_wrote_its_result_completed_even_if_torchrun_then_failed(tmp_path):
    # A Ctrl-C that reaches torchrun after the last step: the workers finished, torchrun exits 1.
    run_dir = make_run_dir(tmp_path, 'echo "{}" > "$(dirname "$0")/result.json"\nexit 1\n')
    assert local.run(run_dir, out=io.BytesIO()) == 0
    assert json.loads((run_dir / "launch.json").read_text())["state"] == "COMPLETED"
    # An old result.json (from before this launch) does not count.
    again = make_run_dir(tmp_path / "again", "exit 1\n")
    (again / "result.json").write_text("{}")
    os.utime(again / "result.json", (0, 0))
    assert local.run(again, out=io.BytesIO()) == 1
