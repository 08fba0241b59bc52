"""Run under torchrun with 4 CPU ranks (dp_shard 2 x cp 2): checks the context-parallel plumbing.

Ring attention itself needs CUDA SDPA kernels; everything around it runs here on gloo: the
mesh dims data parallelism uses under cp, the data coordinates, and the in-place sharding of
tokens, targets and RoPE rows that keeps every token at its true position.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from trainctl.core.dims import ParallelDims
from trainctl.models.common.rope import rope_frequencies
from trainctl.train.parallel.context_parallel import cp_mesh_of, sharded_sequences
from trainctl.train.parallel.distributed import build_mesh, dp_coordinates
from trainctl.train.parallel.parallelize import dp_mesh_for

SEQ, BATCH, CP = 16, 3, 2


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = build_mesh(ParallelDims(dp_replicate=1, dp_shard=2, cp=CP, tp=1, pp=1), torch.device("cpu"))
    cp_mesh = cp_mesh_of(mesh)
    assert cp_mesh is not None and cp_mesh.size() == CP
    # Gradients average over every rank that holds the same parameters: all 4 here.
    assert dp_mesh_for(("dp_shard",), mesh).size() == 4 and dp_mesh_for(("dp_replicate",), mesh).size() == 4
    assert dp_mesh_for(("dp_replicate", "dp_shard"), mesh).size() == 4
    # cp ranks read the same data: 2 distinct data-parallel coordinates.
    dp_rank, dp_size = dp_coordinates(mesh)
    assert dp_size == 2
    seen = [None] * 4
    dist.all_gather_object(seen, (dp_rank, cp_mesh.get_local_rank()))
    assert sorted(seen) == [(0, 0), (0, 1), (1, 0), (1, 1)], seen

    positions = torch.arange(SEQ).expand(BATCH, SEQ).contiguous()
    inputs, targets = positions.clone(), positions + 100
    full_freqs = rope_frequencies(8, 64, 10000.0)[:SEQ]
    model = SimpleNamespace(freqs=full_freqs)  # all sharded_sequences reads of the model
    with sharded_sequences(cp_mesh, model, inputs, targets) as freqs:
        local_positions = inputs[0].tolist()
    cp_rank = cp_mesh.get_local_rank()
    chunk = SEQ // (2 * CP)
    # Head-tail load balancing: chunks r and 2cp-1-r of 2cp.
    expected = list(range(cp_rank * chunk, (cp_rank + 1) * chunk)) + list(range((2 * CP - 1 - cp_rank) * chunk, (2 * CP - cp_rank) * chunk))
    assert local_positions == expected, (rank, local_positions, expected)
    assert inputs.shape == (BATCH, SEQ // CP) and torch.equal(targets, inputs + 100)
    # Each token keeps its own RoPE row.
    assert torch.equal(freqs, full_freqs[inputs[0]])
    print(f"rank {rank} cp plumbing ok: positions {local_positions}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
