"""`activation_checkpointing=op` keeps every matmul's output, float8 ones (torchao's, counted at torch._scaled_mm)
included, and the float8 scales' amax: backward re-runs only pointwise work (issues 22, 31)."""

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


def test_op_mode_saves_matmuls_and_amax_and_recomputes_pointwise():
    for op in (torch.ops.aten.mm.default, torch.ops.aten.max.default, torch.ops.aten.amax.default):
        assert save_matmuls_policy(None, op) == CheckpointPolicy.MUST_SAVE
    assert save_matmuls_policy(None, torch.ops.aten.mul.Tensor) == CheckpointPolicy.PREFER_RECOMPUTE

def float8_matmul_calls(monkeypatch, mode: str, device: str) -> int:
    """torch._scaled_mm calls of a float8 MLP's forward and backward, wrapped for `mode` ("" for none).

    Counted where torchao calls it: a TorchDispatchMode sits above torchao's float8 tensor subclass and sees
    aten.mm there, never _scaled_mm (the selective-checkpoint policy, a dispatch mode too, sees the same).
    """
    float8 = pytest.importorskip("torchao.float8")
    real, calls = torch._scaled_mm, [0]

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counting)
    torch.manual_seed(0)
    mlp = float8.convert_to_float8_training(_mlp(64).to(device, torch.bfloat16))
    block = checkpoint_block(mlp, mode) if mode else mlp
    x = torch.randn(2, 32, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    block(x).float().square().sum().backward()
    monkeypatch.setattr(torch, "_scaled_mm", real)
    return calls[0]


def _cpu_scaled_mm() -> bool:
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(()), scale_b=torch.ones(()), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def test_op_mode_reruns_no_float8_matmul(monkeypatch):
    """torchao's float8 Linear on CPU calls torch._scaled_mm as on CUDA: op mode re-runs none of them in backward.

    They are kept because the policy saves aten.mm (what it sees of a float8 matmul), not by `_scaled_mm` in the
    list, which no dispatch mode above torchao's subclass ever sees (eager or compiled)."""
    if not _cpu_scaled_mm():
        pytest.skip("this torch build has no CPU torch._scaled_mm")
    plain, op, full = (float8_matmul_calls(monkeypatch, mode, "cpu") for mode in ("", "op", "full"))
    assert plain == 6  # 2 Linears: 1 forward and 2 backward (input and weight gradients) matmuls each
    assert op == plain and full == plain + 2


def test_op_mode_sees_float8_matmuls_as_mm_and_saves_their_amax():
    """What the policy sees of a float8 MLP: aten.mm (saved) and the scales' aten.max (saved: not recomputed)."""
    float8 = pytest.importorskip("torchao.float8")

    def counts(mode: str) -> dict:
        torch.manual_seed(0)
        mlp = float8.convert_to_float8_training(_mlp(64).to(torch.bfloat16))
        block = checkpoint_block(mlp, mode) if mode else mlp
        x = torch.randn(2, 32, 64, dtype=torch.bfloat16, requires_grad=True)
        return _matmul_calls(block, x, ["mm", "max", "_scaled_mm"])

    plain, op = counts(""), counts("op")
    assert plain["_scaled_mm"] == 0 and plain["mm"] > 0  # the subclass turns aten.mm into _scaled_mm below the mode
    assert op["mm"] == plain["mm"] and op["max"] == plain["max"]
