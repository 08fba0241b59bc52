"""A worker run joins a process group its host program already formed, and leaves it up (many_runs_worker.py
trains several runs in one process that way); a group it formed itself it ends."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from trainctl.config.schema import ClusterConfig
from trainctl.train.errors import WorkerConfigError
from trainctl.train.parallel import distributed

pytestmark = pytest.mark.dist


@pytest.fixture
def world_of_one(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_formed_group_is_joined_and_left_up(world_of_one):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    world = distributed.init_distributed(ClusterConfig())
    assert world.world_size == 1 and dist.is_initialized()
    distributed.close_distributed()
    assert dist.is_initialized()  # the host program's group: still there for its next run


def test_a_group_of_another_size_is_refused(world_of_one, monkeypatch):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(WorkerConfigError, match="WORLD_SIZE=2"):
        distributed.init_distributed(ClusterConfig())


def test_a_group_it_formed_is_ended(world_of_one):
    distributed.init_distributed(ClusterConfig())
    assert dist.is_initialized()
    distributed.close_distributed()
    assert not dist.is_initialized()
