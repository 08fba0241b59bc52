"""core/lean_process: a worker's or tool child's end without the teardown of its modules loses nothing the
interpreter's own exit would have kept (non-daemon threads finish, an idle thread pool does not hold it, atexit
handlers run, logging's shutdown flushes and closes the log file, stdout's buffered text is written, the exit code
is the one given); a tool's module runs with its imports outside the garbage collector."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.cli

PROGRAM = textwrap.dedent("""
    import atexit, logging, sys, threading, time
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path
    from trainctl.core.lean_process import exit_now

    folder = Path(sys.argv[1])
    logging.basicConfig(filename=folder / "run.log", level=logging.INFO)
    logging.getLogger("t").info("logged before the end")
    atexit.register(lambda: (folder / "atexit").write_text("ran"))

    def late_writer():
        time.sleep(0.3)
        (folder / "thread").write_text("finished")

    threading.Thread(target=late_writer).start()
    pool = ThreadPoolExecutor(2)  # left running, as Inductor's compile pool is: it must not hold the exit
    pool.submit(lambda: None).result()
    sys.stdout.write("buffered, no newline")  # a pipe: block-buffered until flushed
    exit_now(int(sys.argv[2]) if sys.argv[2] != "none" else None)
""")


@pytest.mark.parametrize("code", ["3", "0", "none"])
def test_threads_atexit_logs_and_stdout_survive_and_the_code_is_kept(tmp_path, code):
    proc = subprocess.run([sys.executable, "-c", PROGRAM, str(tmp_path), code], capture_output=True, text=True,
                          timeout=60, env={"PYTHONUNBUFFERED": "", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == (0 if code == "none" else int(code)), proc.stderr
    assert proc.stdout == "buffered, no newline"
    assert (tmp_path / "thread").read_text() == "finished"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert "logged before the end" in (tmp_path / "run.log").read_text()


TOOL = textwrap.dedent("""
    import gc, sys
    AT_IMPORT = gc.isenabled()

    def main(argv):
        print(f"import {AT_IMPORT} main {gc.isenabled()} argv {argv}")
        return int(argv[0])
""")


def test_a_module_runs_with_its_imports_outside_the_collector_and_its_code_inside(tmp_path):
    (tmp_path / "some_tool.py").write_text(TOOL)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "trainctl.core.lean_process", "some_tool", "5", "x y"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 5, proc.stderr
    assert proc.stdout == "import False main True argv ['5', 'x y']\n"


def test_without_a_module_it_says_how_to_call_it():
    proc = subprocess.run([sys.executable, "-m", "trainctl.core.lean_process"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "usage: python -m trainctl.core.lean_process MODULE" in proc.stderr


def test_the_collector_is_off_inside_and_as_it_was_after():
    import gc

    from trainctl.core.lean_process import imports_without_gc

    was = gc.isenabled()
    try:
        for before in (True, False):
            (gc.enable if before else gc.disable)()
            with imports_without_gc():
                assert not gc.isenabled()
            assert gc.isenabled() == before
    finally:
        (gc.enable if was else gc.disable)()
