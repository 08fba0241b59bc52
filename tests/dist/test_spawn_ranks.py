"""tests/dist/spawn_ranks.py, which starts the ranks of the worker tests: each rank gets torchrun's environment and
forms its group through env://; a failing rank ends its peers and gives its exit code."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.helpers import run_ranks

pytestmark = pytest.mark.dist

PROGRAM = """
import os, sys, time
import torch, torch.distributed as dist
rank = int(os.environ["RANK"])
if sys.argv[1] == "fail":
    if rank == 1:
        sys.exit(3)
    time.sleep(600)  # a peer stuck in a collective: the starter must end it
dist.init_process_group("gloo")
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
# One write per line: with PYTHONUNBUFFERED, print's text and its newline are two writes, which the ranks' shared
# pipe can interleave.
os.write(1, (f"rank {rank} of {os.environ['WORLD_SIZE']} local {os.environ['LOCAL_RANK']} sum {total.item():g} "
             f"main {__name__} argv {sys.argv[1:]}\\n").encode())
dist.destroy_process_group()
"""


def program(tmp_path: Path) -> str:
    path = tmp_path / "ranks_program.py"
    path.write_text(PROGRAM)
    return str(path)


def test_each_rank_gets_its_place_and_the_group_forms(tmp_path):
    proc = run_ranks(3, program(tmp_path), "ok", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    assert lines == [f"rank {r} of 3 local {r} sum 6 main __main__ argv ['ok']" for r in range(3)], proc.stdout


def test_a_failing_rank_ends_its_peers_and_gives_its_exit_code(tmp_path):
    started = time.monotonic()
    proc = run_ranks(2, program(tmp_path), "fail", timeout=120)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert time.monotonic() - started < 100  # rank 0 would have slept 600 s
