"""The optimizer step's measured temporaries (peak_memory.PeakMeter, CPU) equal the plan's (core/optimizers.py).

In one process, on plain tensors: foreach AdamW over two param groups (the larger group's denominator, not the sum of
both), Muon with AdamW (Newton-Schulz on the largest matrix) and Adafactor (for-loop and foreach, in the module's order
and in zero1's largest-first order). The sharded cases are tests/dist/test_plan_memory.py's.
"""

from __future__ import annotations

import pytest
import torch

from trainctl.config.schema import ModelConfig, OptimConfig, PrecisionConfig, ShardingConfig, TrainConfig
from trainctl.core import optimizers
from trainctl.core.dims import ParallelDims
from trainctl.core.tensors import Tensor
from trainctl.models.build import build_model
from trainctl.plan import memory
from trainctl.plan.shapes import stage_tensors, zero1_assignment
from trainctl.plan.stages import rank_stages
from trainctl.train.muon import MuonWithAdamW
from trainctl.train.observe.peak_memory import Allocation, PeakMeter, own_thread, without_workspace
from trainctl.train.optim import build_optimizer, param_groups

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


# Matrices of three sizes in a row (attention, MLP, output), an embedding, norms: Adafactor's peak depends on which
# tensor follows which (the previous one's update is still bound), so a real model's order is the case that counts.
LLAMA = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=128, max_seq_len=64)


def llama() -> tuple[torch.nn.Module, list[Tensor]]:
    torch.manual_seed(0)
    model = build_model(LLAMA, "cpu")
    model.init_weights()
    return model, stage_tensors(LLAMA, range(LLAMA.n_layers), True, True)


def test_adafactors_for_loop_step_holds_what_the_plan_says_in_the_modules_order():
    """The worker's Adafactor on CPU (build_optimizer: torch's for-loop) over its two groups, in the module's order."""
    model, tensors = llama()
    assert [name for name, _ in model.named_parameters()] == [t.name for t in tensors]  # the plan's order is torch's
    opt = build_optimizer(model, OptimConfig(name="adafactor", lr=1e-2, weight_decay=0.1), "cpu")
    assert not opt.param_groups[0]["foreach"]
    record = measured_step(opt, list(model.parameters()))
    planned = optimizers.step_temp_bytes("adafactor", tensors, tensors, False)
    whole = max(4 * (t.numel + t.rows + t.cols + 1) for t in tensors)  # the largest matrix's own, nothing before it
    assert record["step_temp_bytes"] == planned > whole


@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
def test_adafactor_in_zero1s_largest_first_order_holds_what_the_plan_says(foreach):
    """ZeroRedundancyOptimizer hands its optimizer each group's share largest first; the plan lists zero1's partition
    so (plan/shapes.zero1_assignment; both sorts are stable, ties in the module's order). One rank's share of one:
    every tensor, reordered."""
    model, tensors = llama()
    by_name = dict(model.named_parameters())
    (mine,) = zero1_assignment(tensors, 1)
    groups = [{**g, "params": sorted(g["params"], key=torch.Tensor.numel, reverse=True)}
              for g in param_groups(model, 0.1)]
    assert [p for g in groups for p in g["params"]] == [by_name[t.name] for t in mine]
    opt = torch.optim.Adafactor(groups, lr=1e-2, foreach=foreach)
    record = measured_step(opt, [p for g in groups for p in g["params"]])
    assert record["step_temp_bytes"] == optimizers.step_temp_bytes("adafactor", mine, mine, foreach)


def test_under_zero1_the_plans_step_temporaries_are_the_largest_any_rank_holds():
    """Each rank steps its share (measured: its groups, largest first, the worker's for-loop); the plan's figure is
    the larger rank's, though the other rank holds more state bytes (Adafactor's temporaries follow the order)."""
    model, tensors = llama()
    sharding, dims = ShardingConfig(strategy="zero1", dp_replicate=2), ParallelDims(dp_replicate=2)
    by_name = dict(model.named_parameters())
    shares = zero1_assignment(tensors, 2)
    measured = []
    for mine in shares:
        params = [by_name[t.name] for t in mine]
        groups = [{"params": [p for p, t in zip(params, mine, strict=True) if t.is_matmul == decayed],
                   "weight_decay": 0.1 if decayed else 0.0} for decayed in (True, False)]
        measured.append(measured_step(torch.optim.Adafactor(groups, lr=1e-2), params)["step_temp_bytes"])
    (stage,) = rank_stages(LLAMA, sharding, 1)
    plan = memory.estimate(LLAMA, PrecisionConfig(), sharding, TrainConfig(), dims, stage, "cpu", "adafactor")
    states = [optimizers.state_bytes("adafactor", mine) for mine in shares]
    assert plan.step_temp == max(measured) and measured.index(max(measured)) != states.index(max(states))


def test_foreach_adafactor_holds_each_groups_updates_at_once():
    """torch's foreach step (the worker's on CUDA, run here on CPU): a group's matrices' estimates all at once, then
    its vectors' beside them; the larger group counts, not their sum."""
    model, tensors = llama()
    opt = torch.optim.Adafactor(param_groups(model, 0.1), lr=1e-2, foreach=True)
    record = measured_step(opt, list(model.parameters()))
    planned = optimizers.step_temp_bytes("adafactor", tensors, tensors, True)
    decayed = sum(t.numel + 1 for t in tensors if t.is_matmul)
    assert record["step_temp_bytes"] == planned == 4 * decayed  # each decayed matrix's estimate + its mean's element


def test_an_operators_own_workspace_and_another_threads_buffers_are_left_out():
    events = [Allocation(1, 100, 0xA, op=0, thread=1),  # a tensor the step's code holds
              Allocation(2, 50, 0xB, op=7, thread=1), Allocation(3, -50, 0xB, op=7, thread=1),  # a matmul's workspace
              Allocation(4, 80, 0xC, op=7, thread=1),  # that matmul's output, freed later outside it
              Allocation(5, 30, 0xD, op=0, thread=2), Allocation(6, -30, 0xD, op=0, thread=2),  # gloo's buffer
              Allocation(7, -100, 0xA, op=0, thread=2)]  # the step's tensor, freed by gloo's thread: still the step's
    kept = without_workspace(own_thread(events, 1))
    assert [(e.ptr, e.size) for e in kept] == [(0xA, 100), (0xC, 80), (0xA, -100)]
