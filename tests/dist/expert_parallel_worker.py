"""Run under torchrun (2 ranks, gloo): GroupedExperts under expert parallelism against one process on the same tokens.

Every rank draws every rank's tokens (the same seeds), so each can compute the one-process reference itself: the
sum of the ranks' losses through the unsplit experts. Under ep=2 each rank feeds only its own tokens, sorted by
expert with uneven counts (one expert gets no token from anyone, one rank sends all its rows to the other rank's
experts); its outputs, its input gradients and its experts' gradients must equal the reference's. Writes one JSON
line per case to the path given, the maximum differences and the bounds the test checks them against.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from trainctl.core.dims import ParallelDims
from trainctl.models.common.experts import GroupedExperts
from trainctl.train.parallel.expert import apply_expert_parallel, build_ep_mesh, expert_dp_mesh

E, DIM, HIDDEN = 4, 8, 16
# Tokens each rank routes to each expert (rank 0 holds experts 0 and 1, rank 1 experts 2 and 3). uneven: expert 3
# gets none, rank 1 sends nothing to its own experts; idle: no token reaches rank 1's experts at all.
ROUTINGS = {"uneven": {0: [3, 1, 2, 0], 1: [2, 5, 0, 0]}, "idle": {0: [1, 2, 0, 0], 1: [3, 1, 0, 0]}}


def tokens(routing: dict, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.tensor(routing[rank], dtype=torch.int64)
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(int(counts.sum()), DIM, generator=gen), counts


def experts() -> GroupedExperts:
    module = GroupedExperts(E, DIM, HIDDEN)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for w in (module.w1, module.w2, module.w3):
            w.copy_(torch.randn(w.shape, generator=gen) / w.shape[1] ** 0.5)
    return module


def loss_of(y: torch.Tensor, rank: int) -> torch.Tensor:
    """A loss that weighs every output element differently, so a misplaced row changes it."""
    gen = torch.Generator().manual_seed(200 + rank)
    return (y * torch.randn(y.shape, generator=gen)).sum()


def reference(routing: dict, rank: int) -> dict[str, torch.Tensor]:
    """One process on every rank's tokens: this rank's outputs and input gradients, and the experts' gradients."""
    module = experts()
    out = {}
    total = 0
    for r in routing:
        x, counts = tokens(routing, r)
        x.requires_grad_(True)
        y = module(x, counts)
        total = total + loss_of(y, r)
        if r == rank:
            out["y"], x_mine = y.detach(), x
    total.backward()
    out["x_grad"] = x_mine.grad
    out.update({name: getattr(module, name).grad for name in ("w1", "w2", "w3")})
    return out


def under_ep(routing: dict, rank: int, fsdp: bool) -> dict[str, torch.Tensor]:
    """This rank's tokens through the experts split over ep=2 (with fsdp: FSDP2 over efsdp as the worker does)."""
    dims = ParallelDims(dp_shard=2, ep=2)
    mesh = build_ep_mesh(dims, "cpu")
    module = experts()
    apply_expert_parallel(module, mesh["ep"], grad_divisor=dims.ep if fsdp else 1)
    if fsdp:
        fully_shard(module, mesh=expert_dp_mesh(mesh, ("dp_shard",)))
    x, counts = tokens(routing, rank)
    x.requires_grad_(True)
    y = module(x, counts)
    loss_of(y, rank).backward()
    scale = dims.dp if fsdp else 1  # FSDP2 averages over the data-parallel ranks; the reference sums them
    out = {"y": y.detach(), "x_grad": x.grad}
    out.update({name: getattr(module, name).grad.to_local() * scale for name in ("w1", "w2", "w3")})
    return out


def compare(rank: int, got: dict, want: dict) -> dict:
    local = E // 2
    diffs = {}
    for key, value in got.items():
        expected = want[key][rank * local:(rank + 1) * local] if key.startswith("w") else want[key]
        assert value.shape == expected.shape, (key, value.shape, expected.shape)
        diffs[key] = {"diff": float((value - expected).abs().max()), "scale": float(expected.abs().max())}
    return diffs


def main(path: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cases = {}
    for name, routing in ROUTINGS.items():
        want = reference(routing, rank)
        cases[f"{name}-ep2"] = compare(rank, under_ep(routing, rank, fsdp=False), want)
        cases[f"{name}-ep2_fsdp"] = compare(rank, under_ep(routing, rank, fsdp=True), want)
    with open(f"{path}.{rank}", "w") as f:
        f.write(json.dumps({"rank": rank, "cases": cases}) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
