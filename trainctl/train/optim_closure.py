"""The closure step() takes in torch.optim's contract, shared by trainctl's own optimizers (lion.py, muon.py)."""

from __future__ import annotations

import torch


def closure_loss(closure):
    """The loss a closure re-evaluates with gradients on (inside step's no_grad), or None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
