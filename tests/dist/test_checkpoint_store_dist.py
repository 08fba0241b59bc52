"""The checkpoint store on 2 gloo ranks: DTensor shards, async commit agreement, one rank failing, resharding.

This file is also the worker: each rank runs it as a script (`main`), the test checks what the ranks printed.
"""

from __future__ import annotations

import errno
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers import run_ranks
from trainctl.train.checkpoint import store as ckpt
from trainctl.train.checkpoint.store import CheckpointError, CheckpointManager, step_name

pytestmark = [pytest.mark.dist, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

FULL = torch.arange(32, dtype=torch.float32).reshape(8, 4)


def test_two_ranks_then_one(tmp_path):
    proc = run_ranks(2, __file__, str(tmp_path), timeout=240)  # this file is also the workers' script
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("checkpoint store ok") == 2, proc.stdout

    # A world of one, no process group: loads the 2-rank sharded checkpoint into a plain tensor.
    manager = CheckpointManager(tmp_path, keep_last=2)
    target = {"model": {"w": torch.zeros(8, 4)}, "schedule": {"step": 0}}
    meta, rank_state = manager.load(tmp_path / step_name(1), target)
    assert torch.equal(target["model"]["w"], FULL) and target["schedule"] == {"step": 1}
    assert meta["world_size"] == 2 and rank_state is None


def sharded_state(mesh, step: int) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    return {"model": {"w": distribute_tensor(FULL + step - 1, mesh, [Shard(0)])}, "schedule": {"step": step}}


def same_everywhere(value) -> bool:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return all(v == values[0] for v in values)


def failing_rank_file_on_rank_1(real_write):
    def write(path, data):
        if dist.get_rank() == 1 and path.name.startswith("rank-"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_write(path, data)

    return write


def check_failure_is_agreed(manager: CheckpointManager, mesh, step: int) -> None:
    real_write = ckpt.write_bytes
    ckpt.write_bytes = failing_rank_file_on_rank_1(real_write)
    try:
        manager.save(step, sharded_state(mesh, step), {"rank": dist.get_rank()}, {})
        manager.wait()
        message = None
    except CheckpointError as exc:
        message = str(exc)
    finally:
        ckpt.write_bytes = real_write
    assert message is not None and "disk full" in message and same_everywhere(message), message
    assert not list(manager.root.glob("*.tmp"))


def check_async_poll_agreement(manager: CheckpointManager, mesh) -> None:
    """Ranks poll at different moments (rank 1 lags); the commit happens in the same poll everywhere."""
    manager.save(2, sharded_state(mesh, 2), {"rank": dist.get_rank()}, {"tokens_seen": 2})
    polls = 0
    while manager._pending is not None:
        time.sleep(0.01 * (1 + dist.get_rank()))
        manager.poll()
        polls += 1
    assert same_everywhere(polls) and [s for s, _ in manager.committed()] == [1, 2]


def check_fallback_and_reshard(manager: CheckpointManager, mesh) -> None:
    from torch.distributed.tensor import Replicate, distribute_tensor

    newest = manager.root / step_name(2)
    files = sorted(p.name for p in newest.iterdir() if p.name != "manifest.json")
    if dist.get_rank() == 0:  # damage a file of rank 1's share of the verification
        victim = newest / files[1]
        victim.write_bytes(victim.read_bytes() + b"x")
    dist.barrier()
    assert manager.latest_valid() == manager.root / step_name(1)
    target = {"model": {"w": distribute_tensor(torch.zeros(8, 4), mesh, [Replicate()])}, "schedule": {"step": 0}}
    meta, rank_state = manager.load(manager.root / step_name(1), target)
    assert torch.equal(target["model"]["w"].full_tensor(), FULL), target["model"]["w"]
    assert meta["world_size"] == 2 and rank_state == {"rank": dist.get_rank()}


def main(root: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    for async_save in (False, True):
        check_failure_is_agreed(CheckpointManager(root / f"fail-{async_save}", keep_last=2, async_save=async_save), mesh, 5)
    manager = CheckpointManager(root, keep_last=3)
    manager.save(1, sharded_state(mesh, 1), {"rank": dist.get_rank()}, {"tokens_seen": 1})
    shards = sorted(p.name for p in (root / step_name(1)).glob("__*"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"], shards
    check_async_poll_agreement(CheckpointManager(root, keep_last=3, async_save=True), mesh)
    check_fallback_and_reshard(manager, mesh)
    print(f"checkpoint store ok {dist.get_rank()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
