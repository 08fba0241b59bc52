"""The RoPE table stays fp32 inside every block under bf16, whichever wrapper casts the weights.

FSDP2's MixedPrecisionPolicy casts a unit's floating forward inputs to the compute dtype by default,
and the blocks take the RoPE table as an argument: bf16 cos/sin tables, while the autocast path keeps
fp32 ones (llama.py computes the rotation in fp32). One process, a fake process group of 2 ranks
(collectives are no-ops: the weights are garbage, but dtypes are what is checked).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from worker_runs import TINY

from trainctl.config.schema import PrecisionConfig, ShardingConfig, TrainConfig
from trainctl.core.dims import ParallelDims
from trainctl.core.wrapping import wrapping_of
from trainctl.models.build import build_model
from trainctl.train.parallel.distributed import build_mesh
from trainctl.train.parallel.parallelize import parallelize, unwrap
from trainctl.train.parallel.precision import autocast_for

pytestmark = pytest.mark.dist

BF16 = PrecisionConfig(compute_dtype="bf16")
LAYOUTS = {
    "zero3": ShardingConfig(strategy="zero3", dp_shard=2),
    "zero2": ShardingConfig(strategy="zero2", dp_shard=2),
    "hsdp": ShardingConfig(strategy="hsdp", dp_replicate=2, dp_shard=1),
    "ddp": ShardingConfig(strategy="ddp", dp_replicate=2),
}


@contextlib.contextmanager
def fake_world(size: int):
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def block_input_dtypes(sharding: ShardingConfig, pass_freqs: bool) -> list[tuple[torch.dtype, torch.dtype]]:
    """(hidden states, RoPE table) dtypes each block's forward receives, in one bf16 forward."""
    device = torch.device("cpu")
    with fake_world(2):
        mesh = build_mesh(ParallelDims.from_config(sharding), device)
        train = TrainConfig(seq_len=16, global_batch=2, micro_batch=1)
        model = parallelize(build_model(TINY, "meta"), mesh, sharding, train, BF16, device)
        seen = []
        for block in unwrap(model).layers.values():
            block.register_forward_pre_hook(lambda mod, args: seen.append((args[0].dtype, args[1].dtype)))
        tokens = torch.randint(0, TINY.vocab_size, (1, 16))
        freqs = unwrap(model).freqs[:16]
        with torch.no_grad(), autocast_for(wrapping_of(sharding, BF16), BF16, device):
            model(tokens, freqs) if pass_freqs else model(tokens)
    return seen


@pytest.mark.parametrize("pass_freqs", [False, True], ids=["own-table", "passed-table"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_blocks_see_an_fp32_rope_table_under_bf16(layout, pass_freqs):
    # passed-table: what context parallelism does (the root receives the slice's rows as an argument).
    seen = block_input_dtypes(LAYOUTS[layout], pass_freqs)
    assert len(seen) == TINY.n_layers
    assert all(freqs == torch.float32 for _, freqs in seen), seen
    if layout != "ddp":  # FSDP2 computes in bf16 weights: the hidden states arrive in bf16 (autocast: fp32)
        assert all(hidden == torch.bfloat16 for hidden, _ in seen), seen
