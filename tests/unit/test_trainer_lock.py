"""The run directory's trainer lock: one holder, named in the refusal, free again when the holder dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import wait_for
from trainctl.core import rundir, trainer_lock


def test_a_second_taker_is_refused_naming_the_first(tmp_path):
    first = trainer_lock.acquire(tmp_path)
    try:
        assert trainer_lock.lock_holder(tmp_path)["pid"] == os.getpid()
        with pytest.raises(trainer_lock.LockHeld, match=f"being trained by pid {os.getpid()} on "):
            trainer_lock.acquire(tmp_path)
    finally:
        first.release()
    assert trainer_lock.lock_holder(tmp_path) is None
    trainer_lock.acquire(tmp_path).release()


@pytest.mark.cli
def test_a_killed_holders_lock_is_taken_over(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", f"""
from trainctl.core import trainer_lock
import time
lock = trainer_lock.acquire({str(tmp_path)!r})
time.sleep(60)
"""])
    try:
        wait_for(lambda: trainer_lock.lock_holder(tmp_path) is not None, "the holder to be recorded", timeout=10)
        with pytest.raises(trainer_lock.LockHeld):
            trainer_lock.acquire(tmp_path)
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        lock = trainer_lock.acquire(tmp_path)  # no stale lock: it died with its holder
        assert rundir.read_json(tmp_path / rundir.HOLDER)["pid"] == os.getpid()
        lock.release()
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.cli
def test_the_lock_passes_to_the_launch_script_and_what_it_execs(tmp_path):
    lock = trainer_lock.acquire(tmp_path, inheritable=True)
    script = f'exec {{fd}}<&{lock.fd}; exec sleep 30'  # keep only an inherited copy, then exec
    child = subprocess.Popen(["bash", "-c", script], pass_fds=(lock.fd,))
    try:
        lock.release()  # the parent lets go; the exec'd child still holds the same lock
        time.sleep(0.3)
        with pytest.raises(trainer_lock.LockHeld):
            trainer_lock.acquire(tmp_path)
    finally:
        child.kill()
        child.wait()
    trainer_lock.acquire(tmp_path).release()


def test_process_identity_tells_a_reused_pid(tmp_path):
    me = trainer_lock.identity()
    assert trainer_lock.same_process(me["pid"], me["pid_start"], me["host"])
    assert not trainer_lock.same_process(me["pid"], "other-boot:1", me["host"])
    assert not trainer_lock.same_process(me["pid"], me["pid_start"], "another-host")
    assert not trainer_lock.same_process("1; rm -rf /", me["pid_start"], me["host"])
