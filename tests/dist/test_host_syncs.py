"""Nothing in a training step reads a device value on the host except the guard's one agreed all-reduce.

On CUDA every `.item()`, `.tolist()`, `float(tensor)` or `.cpu()` of a device tensor is a host sync that stalls
the launch queue; a step may have one (guards.agreed_step: loss, grad norm and stop, agreed across ranks). On
CPU nothing syncs, so this counts the calls instead, over steps that neither log nor measure memory; the CUDA
twin (tests/gpu) counts real syncs with torch.cuda.set_sync_debug_mode. One process, a gloo world of one.
"""

from __future__ import annotations

import collections
from dataclasses import replace

import pytest
import torch
from worker_runs import base_config

from trainctl.config.schema import LoggingConfig, ShardingConfig
from trainctl.train.loop.job_setup import setup
from trainctl.train.loop.step import train_step
from trainctl.train.loop.stop import StopRequest
from trainctl.train.parallel import distributed

pytestmark = pytest.mark.dist

READS = ("item", "tolist", "__float__", "cpu", "numpy")


@pytest.mark.parametrize("strategy", ["none", "zero3"])
def test_a_training_step_reads_the_device_once(tmp_path, data_cache, monkeypatch, strategy):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    cfg = base_config(data_cache, steps=8, micro_batch=4, grad_accum=2)
    cfg = replace(cfg, sharding=ShardingConfig(strategy=strategy), logging=LoggingConfig(log_every=100, progress=False))
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    world = distributed.init_distributed(cfg.cluster)
    try:
        job = setup(cfg, run_dir, world, StopRequest())
        for step in range(4):  # the third step measures memory: past it
            train_step(job, step)
        counts = collections.Counter()
        # AdamW's step counts are host tensors even on CUDA (fused/foreach read them without a device sync).
        host_steps = {id(state["step"]) for state in job.optimizer.state.values() if "step" in state}
        for name in READS:
            original = getattr(torch.Tensor, name)

            def counting(self, *args, _name=name, _original=original, **kwargs):
                if id(self) not in host_steps:
                    counts[_name] += 1
                return _original(self, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counting)
        train_step(job, 4)
        train_step(job, 5)
        monkeypatch.undo()
        assert counts == {"tolist": 2}, dict(counts)  # one agreed all-reduce per step, nothing else
        job.metrics.close()
    finally:
        distributed.close_distributed()
