"""train/agent.py, the torchrun that forks its ranks (cluster.rank_start=fork): the arguments it hands torchrun and
what it refuses; train/rank_process.py: a forked rank's fresh start (the agent's signal and exit handlers and its
process name dropped) and its end.

Its runs themselves (losses bitwise equal to plain torchrun's, kills, restarts, hangs and stops of forked ranks) are
tests/dist/test_rank_start.py's and the dist tier's: every CLI launch on cpu forks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainctl.train import agent, rank_process

pytestmark = pytest.mark.cli


def test_torchrun_gets_its_own_options_and_the_worker_as_a_forked_run_path_entry():
    options = ["--standalone", "--nnodes=1", "--nproc_per_node=2", "--log-dir=/r/logs/torchrun", "--redirects=3"]
    argv = agent.torchrun_argv([*options, "-m", "trainctl.train", "/r"])
    assert argv == [*options, "--start-method=fork", "--run-path", str(agent.WORKER_MAIN), "/r"]
    assert agent.WORKER_MAIN.is_file() and agent.WORKER_MAIN.parent.name == "train"


@pytest.mark.parametrize("argv", [
    [], ["/r"], ["--standalone", "-m", "other.module", "/r"], ["--standalone", "script.py", "/r"],
    ["--standalone", "-m", "trainctl.train"],  # no run directory
    ["--start-method=spawn", "-m", "trainctl.train", "/r"], ["--run-path", "-m", "trainctl.train", "/r"],
    ["--no-python", "-m", "trainctl.train", "/r"]])
def test_anything_but_the_worker_with_torchruns_options_is_refused(argv):
    with pytest.raises(ValueError, match="usage: python -m trainctl.train.agent"):
        agent.torchrun_argv(argv)


def test_a_bad_command_line_is_one_line_and_exit_2_before_torch_is_imported():
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "trainctl.train.agent", "--standalone",
                           "-m", "other", "/r"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert len(lines) == 1 and lines[0].startswith("usage: python -m trainctl.train.agent"), proc.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "trainctl.core.lean_process" in imported and "torch" not in imported


FORKED = textwrap.dedent("""
    import atexit, os, signal, sys
    from pathlib import Path
    from trainctl.train import rank_process

    out = Path(sys.argv[1])
    def raise_in_agent(signum, frame):
        raise RuntimeError("the agent's handler")
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2):
        signal.signal(sig, raise_in_agent)
    rank_process.name_process("pt_elastic")  # torchrun names its main thread so
    atexit.register(lambda: (out / "agent-atexit").write_text("ran"))
    os.environ[rank_process.AGENT_PID_ENV] = str(os.getpid())
    pid = os.fork()
    if pid == 0:
        assert rank_process.is_forked_rank()
        rank_process.as_new_rank()
        atexit.register(lambda: (out / "rank-atexit").write_text("ran"))
        names = {s.name: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2,
                                                       signal.SIGPIPE)}
        (out / "handlers").write_text(repr({k: v.name if isinstance(v, signal.Handlers) else v.__name__
                                            for k, v in names.items()}))
        (out / "name").write_text(Path("/proc/self/comm").read_text().strip())
        rank_process.end_rank(0)  # a forked rank's success returns (to torchrun's wrapper)...
        (out / "returned").write_text("yes")
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), rank_process.is_forked_rank())
    os._exit(0)
""")


def test_a_forked_rank_drops_the_agents_signal_and_exit_handlers_and_its_success_returns(tmp_path):
    proc = subprocess.run([sys.executable, "-c", FORKED, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["0", "False"], proc.stderr[-3000:]  # the agent itself is not a forked rank
    handlers = eval((tmp_path / "handlers").read_text())
    assert handlers == {"SIGTERM": "SIG_DFL", "SIGINT": "default_int_handler", "SIGHUP": "SIG_DFL",
                        "SIGUSR2": "SIG_DFL", "SIGPIPE": "SIG_IGN"}, handlers
    assert (tmp_path / "name").read_text() == Path(sys.executable).name[:15]  # as `ps` shows an exec'd rank
    assert (tmp_path / "returned").read_text() == "yes"
    assert (tmp_path / "rank-atexit").read_text() == "ran"  # the rank's own exit handlers ran before it returned
    assert not (tmp_path / "agent-atexit").exists()  # the agent's never ran in the rank (nor in the agent: _exit)


@pytest.mark.parametrize(("forked", "code"), [(False, 0), (False, 3), (True, 3)])
def test_a_rank_that_is_not_a_forked_success_exits_with_its_code(tmp_path, forked, code):
    program = textwrap.dedent(f"""
        import os, sys
        from trainctl.train import rank_process
        if {forked}:
            os.environ[rank_process.AGENT_PID_ENV] = str(os.getppid())
        rank_process.end_rank({code})
        print("returned")
    """)
    env = {k: v for k, v in os.environ.items() if k != rank_process.AGENT_PID_ENV}
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == code and "returned" not in proc.stdout, proc.stderr[-2000:]
