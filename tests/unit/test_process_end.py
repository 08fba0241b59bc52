"""core/process_end.exit_now: a worker's or tool child's end without the teardown of its modules loses nothing the
interpreter's own exit would have kept: non-daemon threads finish, atexit handlers run (logging's shutdown flushes
and closes the log file), stdout's buffered text is written, and the exit code is the one given."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.cli

PROGRAM = textwrap.dedent("""
    import atexit, logging, sys, threading, time
    from pathlib import Path
    from trainctl.core.process_end import exit_now

    folder = Path(sys.argv[1])
    logging.basicConfig(filename=folder / "run.log", level=logging.INFO)
    logging.getLogger("t").info("logged before the end")
    atexit.register(lambda: (folder / "atexit").write_text("ran"))

    def late_writer():
        time.sleep(0.3)
        (folder / "thread").write_text("finished")

    threading.Thread(target=late_writer).start()
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
