"""The optimizer step's measured temporaries (peak_memory.PeakMeter, CPU) equal the plan's (core/optimizers.py).

In one process, on plain tensors: foreach AdamW over two param groups (the larger group's denominator, not the sum of
both) and Muon with AdamW (Newton-Schulz on the largest matrix). The sharded cases are tests/dist/test_plan_memory.py's.
"""

from __future__ import annotations

import torch

from trainctl.core import optimizers
from trainctl.core.tensors import Tensor
from trainctl.train.muon import MuonWithAdamW
from trainctl.train.observe.peak_memory import Allocation, PeakMeter, own_thread, without_workspace

# Matrices with different sides (Newton-Schulz's m^2 terms are not n's), a bias, and an embedding-named matrix.
SHAPES = {"tok_embeddings.weight": (100, 64), "layers.0.w1.weight": (256, 64), "layers.0.w1.bias": (256,),
          "layers.0.w2.weight": (64, 256)}


def params() -> dict[str, torch.nn.Parameter]:
    torch.manual_seed(0)
    return {name: torch.nn.Parameter(torch.randn(shape)) for name, shape in SHAPES.items()}


def specs() -> list[Tensor]:
    return [Tensor(name, shape[0], shape[1] if len(shape) > 1 else 1) for name, shape in SHAPES.items()]


def measured_step(opt: torch.optim.Optimizer, ps: list[torch.Tensor]) -> dict:
    """The third step's record (states exist from the first), as the worker measures it."""
    module = torch.nn.Module()
    for i, p in enumerate(ps):
        module.register_parameter(f"p{i}", p)
    for step in range(3):
        for p in ps:
            p.grad = torch.randn_like(p)
        if step < 2:
            opt.step()
            continue
        meter = PeakMeter(torch.device("cpu"), module, opt)
        with meter.optimizer_step():
            opt.step()
        return meter.stop()
    raise AssertionError("unreachable")


def test_foreach_adamw_steps_one_group_at_a_time():
    p = params()
    decayed = [p["layers.0.w1.weight"], p["layers.0.w2.weight"]]
    rest = [p["tok_embeddings.weight"], p["layers.0.w1.bias"]]
    opt = torch.optim.AdamW([{"params": decayed, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            foreach=True)
    record = measured_step(opt, decayed + rest)
    planned = optimizers.step_temp_bytes("adamw", specs(), specs(), False)
    assert record["step_temp_bytes"] == planned == 4 * 2 * 256 * 64  # the decayed group's, not all four tensors'


def test_muon_holds_its_update_and_newton_schulz_iterates_of_the_largest_matrix():
    p = params()
    hidden = [p["layers.0.w1.weight"], p["layers.0.w2.weight"]]
    rest = [p["tok_embeddings.weight"], p["layers.0.w1.bias"]]
    opt = MuonWithAdamW([{"params": hidden, "weight_decay": 0.1, "muon": True},
                         {"params": rest, "weight_decay": 0.0, "muon": False}],
                        lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw",
                        betas=(0.9, 0.95), eps=1e-8, foreach=True)
    record = measured_step(opt, hidden + rest)
    n, m = 256 * 64, 64
    assert record["step_temp_bytes"] == optimizers.step_temp_bytes("muon", specs(), specs(), False) \
        == 4 * n + 2 * (2 * n + 2 * m * m)


def test_an_operators_own_workspace_and_another_threads_buffers_are_left_out():
    events = [Allocation(1, 100, 0xA, op=0, thread=1),  # a tensor the step's code holds
              Allocation(2, 50, 0xB, op=7, thread=1), Allocation(3, -50, 0xB, op=7, thread=1),  # a matmul's workspace
              Allocation(4, 80, 0xC, op=7, thread=1),  # that matmul's output, freed later outside it
              Allocation(5, 30, 0xD, op=0, thread=2), Allocation(6, -30, 0xD, op=0, thread=2),  # gloo's buffer
              Allocation(7, -100, 0xA, op=0, thread=2)]  # the step's tensor, freed by gloo's thread: still the step's
    kept = without_workspace(own_thread(events, 1))
    assert [(e.ptr, e.size) for e in kept] == [(0xA, 100), (0xC, 80), (0xA, -100)]
