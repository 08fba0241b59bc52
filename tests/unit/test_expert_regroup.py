"""Expert parallelism's regroup (train/parallel/expert.regroup_order): rows received in (source rank, local expert)
blocks reordered into (local expert, source rank) blocks, empty blocks included."""

from __future__ import annotations

import pytest
import torch

from trainctl.train.parallel.expert import regroup_order


def by_blocks(received: list[list[int]]) -> list[int]:
    """The reference: walk the blocks expert-major, each block's rows in order."""
    starts, row = {}, 0
    for s, counts in enumerate(received):
        for e, n in enumerate(counts):
            starts[s, e], row = row, row + n
    return [starts[s, e] + i for e in range(len(received[0])) for s in range(len(received))
            for i in range(received[s][e])]


@pytest.mark.parametrize("received", [
    [[3, 1], [2, 5]],
    [[0, 2], [3, 0]],
    [[0, 0], [0, 0]],
    [[1, 0, 2], [0, 0, 1], [4, 1, 0], [2, 2, 2]],
])
def test_regroup_order_is_expert_major(received):
    order = regroup_order(torch.tensor(received, dtype=torch.int64))
    assert order.tolist() == by_blocks(received)
    assert sorted(order.tolist()) == list(range(sum(map(sum, received))))  # a permutation
