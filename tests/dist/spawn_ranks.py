"""N ranks of a program on this host, with the environment torchrun gives them but without torchrun's agent, and
with torch imported once: for the worker tests whose subject is what the workers compute (layouts against one
process, checkpoints, imports). The tests of torchrun's own part (the CLI's launches, restarts, hangs, stops and
faults) keep torchrun.

Each rank of a torchrun imports torch, DTensor, torch._dynamo and the worker's modules itself (about 4.5 s of one
core on a 2-core CPU host), after the agent has imported torch for itself (2 s more). Here one process imports them
(PRELOAD, no thread started), then forks the ranks: each gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK, ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT
and TORCHELASTIC_MAX_RESTARTS, runs PROGRAM as `python PROGRAM` would (a script as __main__ with its folder first
on sys.path, or -m MODULE), forms its process group through env:// as under torchrun, and ends as the worker does,
without Python's teardown of torch's modules (trainctl.core.lean_process.py). When a rank fails, the
others get SIGTERM (SIGKILL after a grace), as torchrun's agent does, and the first failure's exit code is this
program's (the lowest rank's, when several have failed by the time it looks). SIGTERM or SIGINT to this program goes on to the ranks.

    python tests/dist/spawn_ranks.py N PROGRAM [ARGS...]      (PROGRAM: a script, or -m MODULE)
"""

from __future__ import annotations

import os
import random
import runpy
import signal
import socket
import sys
import time
import traceback

from trainctl.core.lean_process import exit_now, imports_without_gc

GRACE_S = 10.0  # after a rank failed: how long its peers get to end on SIGTERM before SIGKILL
POLL_S = 0.02
# What every worker program of the tests imports: loaded before the fork, shared by the ranks.
# (Not trainctl.train.__main__: runpy would warn that `-m trainctl.train` finds it imported already.)
PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.checkpoint", "torch._dynamo",
           "trainctl.config.load", "trainctl.train.loop.trainer")


def free_port() -> int:
    """A port below the kernel's ephemeral range that nobody listens on now: the ports the kernel hands out by
    itself (torchrun's store, gloo's connections, another test's) never collide with it while rank 0 binds it."""
    low = 32768
    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {low}")


def rank_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(nproc),
            "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_RUN_ID": f"spawn-{os.getpid()}", "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0"}


def run_program(program: list[str]) -> int:
    """PROGRAM in this (forked) process as `python PROGRAM` runs it; its exit code."""
    try:
        if program[0] == "-m":
            sys.argv = [program[1], *program[2:]]
            runpy.run_module(program[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(program)
            sys.path.insert(0, os.path.dirname(os.path.abspath(program[0])))
            runpy.run_path(program[0], run_name="__main__")
        return 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:  # as the interpreter reports an uncaught exception
        traceback.print_exc()
        return 1


def start_rank(rank: int, nproc: int, port: int, program: list[str]) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL if sig == signal.SIGTERM else signal.default_int_handler)
        os.environ.update(rank_env(rank, nproc, port))
        code = run_program(program)
    finally:
        exit_now(code)


def exit_code(status: int) -> int:
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def reap(pids: dict[int, int | None]) -> None:
    """Record the exit codes of the ranks that have ended (pid -> code; None while running)."""
    for pid, code in pids.items():
        if code is None:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                pids[pid] = exit_code(status)


def end_all(pids: dict[int, int | None], sig: int) -> None:
    for pid, code in pids.items():
        if code is None:
            os.kill(pid, sig)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and None in pids.values():
        time.sleep(POLL_S)
        reap(pids)
    for pid, code in pids.items():
        if code is None:
            os.kill(pid, signal.SIGKILL)
            pids[pid] = exit_code(os.waitpid(pid, 0)[1])


def run(nproc: int, program: list[str]) -> int:
    with imports_without_gc():
        for module in PRELOAD:
            __import__(module)
    port = free_port()
    pids: dict[int, int | None] = {}

    def forward(signum, _frame):
        end_all(pids, signum)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    for rank in range(nproc):
        pids[start_rank(rank, nproc, port, program)] = None
    while True:
        reap(pids)
        failed = [code for code in pids.values() if code not in (None, 0)]
        if failed:
            end_all(pids, signal.SIGTERM)
            return failed[0]
        if None not in pids.values():
            return 0
        time.sleep(POLL_S)


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit() or int(argv[0]) < 1:
        print("usage: spawn_ranks.py N PROGRAM [ARGS...]", file=sys.stderr)
        return 2
    return run(int(argv[0]), argv[1:])


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
