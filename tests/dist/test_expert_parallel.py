"""Expert parallelism on 2 ranks (gloo): GroupedExperts split over ep=2 computes what one process does.

The worker (expert_parallel_worker.py) feeds each rank's tokens, sorted by expert with uneven counts, an expert
no rank routes to and a rank whose experts get no token at all, through the experts split over ep=2 (alone, and under FSDP2 over the remaining ranks with the
worker's gradient divisor), and compares the outputs, the input gradients and each rank's experts' gradients with
one process on every rank's tokens. Only the order of the gradient sums differs, so the bound is fp32 rounding
over one SwiGLU chain and its backward.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from expert_parallel_worker import DIM, HIDDEN, ROUTINGS

from tests.helpers import rounding_rel, run_ranks

pytestmark = pytest.mark.dist

HERE = Path(__file__).parent


@pytest.mark.parity
def test_experts_split_over_ep_match_one_process(tmp_path):
    out = tmp_path / "ep"
    proc = run_ranks(2, str(HERE / "expert_parallel_worker.py"), str(out), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tokens = max(sum(sum(c) for c in routing.values()) for routing in ROUTINGS.values())
    # forward: the w1/w3 and w2 products (DIM, HIDDEN terms); backward the same chain transposed; a weight's
    # gradient sums over every token it saw
    rel = rounding_rel(torch.float32, 2 * (DIM + HIDDEN) + tokens)
    checked = 0
    for rank in (0, 1):
        cases = json.loads(Path(f"{out}.{rank}").read_text())["cases"]
        assert set(cases) == {f"{name}-{layout}" for name in ROUTINGS for layout in ("ep2", "ep2_fsdp")}
        for case, diffs in cases.items():
            assert set(diffs) == {"y", "x_grad", "w1", "w2", "w3"}
            for key, d in diffs.items():
                # idle: rank 1's experts see no token, their gradients are exactly zero
                assert d["scale"] > 0 or (case.startswith("idle") and rank == 1 and key.startswith("w")), (case, key)
                assert d["diff"] <= rel * d["scale"], f"{case} rank {rank} {key}: {d} beyond rounding ({rel:.2e})"
                checked += 1
    assert checked == 40
