"""N ranks of a program on this host, started as torchrun starts them but without torchrun's agent: for the worker
tests whose subject is what the workers compute (layouts against one process, checkpoints, imports). The tests of
torchrun itself (the CLI's launches, restarts, hangs, stops and faults) keep torchrun.

The agent imports torch before it starts a worker (about 2 s of one core on a 2-core CPU host) and tears it down
after the workers end (about 0.5 s more); this program imports nothing heavy. Each rank gets the variables torchrun
gives (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS) and forms its process group
through env://, as under torchrun. When a rank fails, the others get SIGTERM (SIGKILL after a grace), as torchrun's
agent does, and the first failure's exit code is this program's. SIGTERM or SIGINT to this program goes on to the
ranks.

    python tests/dist/spawn_ranks.py N PROGRAM [ARGS...]      (PROGRAM: a script, or -m MODULE)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

GRACE_S = 10.0  # after a rank failed: how long its peers get to end on SIGTERM before SIGKILL
POLL_S = 0.02


def free_port() -> int:
    """A port nobody listens on now (rank 0's store binds it a moment later, as torchrun --standalone's does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    return {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(nproc), "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": f"spawn-{os.getpid()}",
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"}


def end_all(procs: list[subprocess.Popen], sig: int) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(sig)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and any(proc.poll() is None for proc in procs):
        time.sleep(POLL_S)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def run(nproc: int, program: list[str]) -> int:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, *program], env=rank_env(rank, nproc, port)) for rank in range(nproc)]

    def forward(signum, _frame):
        end_all(procs, signum)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while True:
        codes = [proc.poll() for proc in procs]
        failed = [code for code in codes if code not in (None, 0)]
        if failed:
            end_all(procs, signal.SIGTERM)
            return failed[0] if failed[0] > 0 else 128 - failed[0]
        if all(code == 0 for code in codes):
            return 0
        time.sleep(POLL_S)


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit() or int(argv[0]) < 1:
        print("usage: spawn_ranks.py N PROGRAM [ARGS...]", file=sys.stderr)
        return 2
    return run(int(argv[0]), argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
