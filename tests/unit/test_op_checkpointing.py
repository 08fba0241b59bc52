"""`activation_checkpointing=op` keeps every matmul's output, float8 ones (_scaled_mm) included: backward re-runs
only pointwise work (issue 22)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

from trainctl.train.parallel.activations import checkpoint_block, save_matmuls_policy

pytestmark = pytest.mark.unit


class CountOps(TorchDispatchMode):
    def __init__(self, names):
        super().__init__()
        self.names, self.counts = names, dict.fromkeys(names, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.counts:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def _matmul_calls(block: nn.Module, x: torch.Tensor, names) -> dict:
    with CountOps(names) as ops:
        block(x).square().sum().backward()
    return ops.counts


def _mlp(dim: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(dim, 2 * dim, bias=False), nn.SiLU(), nn.Linear(2 * dim, dim, bias=False))


def test_op_mode_reruns_no_matmul_in_backward():
    x = torch.randn(4, 16, 32, requires_grad=True)
    plain = _matmul_calls(_mlp(), x, ["mm"])
    op = _matmul_calls(checkpoint_block(_mlp(), "op"), x, ["mm"])
    full = _matmul_calls(checkpoint_block(_mlp(), "full"), x, ["mm"])
    assert op == plain and full["mm"] > plain["mm"]  # the count can tell: full re-runs the forward's matmuls


def test_op_mode_keeps_float8_matmul_outputs():
    """On a GPU torchao's float8 Linear runs aten._scaled_mm (on this CPU it emulates with mm, so the op count
    above cannot see it: tests/gpu/test_cuda_training.py counts it on CUDA)."""
    assert save_matmuls_policy(None, torch.ops.aten._scaled_mm.default) == CheckpointPolicy.MUST_SAVE
    assert save_matmuls_policy(None, torch.ops.aten.mul.Tensor) == CheckpointPolicy.PREFER_RECOMPUTE
