"""Step guards: non-finite policies, the consecutive-skip cap, the loss-spike detector, agreed values."""

from __future__ import annotations

import functools
import logging
import math
import random

import pytest
import torch

from tests.faults import worker_faults
from trainctl.config.schema import GuardsConfig
from trainctl.train.loop.guards import NonFiniteError, StepGuard, agreed_step
from trainctl.train.loop.loss import TokenLoss

NAN, INF = float("nan"), float("inf")


def agreed_values(loss, grad_norm):
    """The (loss, grad norm) part of the step's agreement, without a stop request."""
    return agreed_step(loss, grad_norm, False)[:2]


def guard(**keys) -> StepGuard:
    return StepGuard(GuardsConfig(**keys))


def feed(g: StepGuard, losses, start: int = 0) -> list[str]:
    return [g.decide(start + i, loss, 1.0) for i, loss in enumerate(losses)]


@pytest.mark.parametrize("loss, grad_norm", [(NAN, 1.0), (2.0, NAN), (INF, 1.0), (2.0, INF), (-INF, 1.0)])
def test_stop_raises_on_any_non_finite_value(loss, grad_norm):
    with pytest.raises(NonFiniteError) as info:
        guard(nonfinite="stop").decide(7, loss, grad_norm)
    message = str(info.value)
    assert "step 7" in message and f"loss={loss:.6g}" in message and f"grad_norm={grad_norm:.6g}" in message
    assert "optim.lr" in message and "guards.nonfinite=skip" in message
    assert (info.value.step, info.value.grad_norm) == (7, grad_norm)


def test_finite_steps_pass_under_both_policies():
    for policy in ("stop", "skip"):
        g = guard(nonfinite=policy)
        assert feed(g, [3.0, 2.9, 2.8]) == ["ok"] * 3
        assert g.metrics() == {"guard_skipped_steps": 0, "guard_loss_spikes": 0, "guard_empty_batches": 0}


def test_skip_skips_and_counts(caplog):
    g = guard(nonfinite="skip", max_consecutive_skips=3)
    with caplog.at_level(logging.WARNING, logger="trainctl.train"):
        assert g.decide(0, 3.0, 1.0) == "ok"
        assert g.decide(1, NAN, NAN) == "skip"
    assert "step 1: skipped" in caplog.text
    assert (g.skipped_steps, g.consecutive_skips) == (1, 1)
    assert g.metrics()["guard_skipped_steps"] == 1


def test_consecutive_cap_raises_on_the_capth_skip_in_a_row():
    g = guard(nonfinite="skip", max_consecutive_skips=3)
    assert g.decide(0, NAN, 1.0) == "skip"
    assert g.decide(1, 2.0, INF) == "skip"
    with pytest.raises(NonFiniteError, match=r"step 2: 3 steps in a row skipped.*max_consecutive_skips=3"):
        g.decide(2, NAN, 1.0)


def test_a_good_step_resets_the_consecutive_counter_not_the_total():
    g = guard(nonfinite="skip", max_consecutive_skips=2)
    decisions = [g.decide(0, NAN, 1.0), g.decide(1, 2.0, 1.0), g.decide(2, NAN, 1.0), g.decide(3, 2.0, 1.0)]
    assert decisions == ["skip", "ok", "skip", "ok"]
    assert (g.skipped_steps, g.consecutive_skips) == (2, 0)
    assert g.decide(4, NAN, 1.0) == "skip"  # one in a row again, under the cap of 2


def test_max_one_consecutive_skip_stops_at_the_first():
    with pytest.raises(NonFiniteError):
        guard(nonfinite="skip", max_consecutive_skips=1).decide(0, NAN, 1.0)


def noisy_plateau(n: int, seed: int = 0, level: float = 3.0, noise: float = 0.02) -> list[float]:
    rng = random.Random(seed)
    return [level + rng.gauss(0, noise) for _ in range(n)]


def test_spike_warn_logs_and_steps(caplog):
    g = guard(spike="warn", spike_window=20, spike_zscore=6.0)
    assert feed(g, noisy_plateau(20)) == ["ok"] * 20
    with caplog.at_level(logging.WARNING, logger="trainctl.train"):
        assert g.decide(20, 5.0, 1.0) == "ok"
    assert "step 20: loss spike" in caplog.text and "guards.spike=warn" in caplog.text
    assert g.metrics() == {"guard_skipped_steps": 0, "guard_loss_spikes": 1, "guard_empty_batches": 0}
    assert len(g._history) == 20 and 5.0 not in g._history, "a spike does not enter the history"


def test_spike_skip_skips_then_recovers():
    g = guard(spike="skip", spike_window=20, max_consecutive_skips=3)
    feed(g, noisy_plateau(20))
    assert g.decide(20, 5.0, 1.0) == "skip"
    assert g.decide(21, 3.01, 1.0) == "ok"
    assert g.metrics() == {"guard_skipped_steps": 1, "guard_loss_spikes": 1, "guard_empty_batches": 0}


def test_spikes_count_toward_the_consecutive_cap():
    g = guard(spike="skip", nonfinite="skip", spike_window=20, max_consecutive_skips=3)
    feed(g, noisy_plateau(20))
    assert [g.decide(20, 5.0, 1.0), g.decide(21, NAN, 1.0)] == ["skip", "skip"]
    with pytest.raises(NonFiniteError, match="last: loss spike"):
        g.decide(22, 6.0, 1.0)


def test_only_upward_jumps_are_spikes():
    g = guard(spike="skip", spike_window=20)
    feed(g, noisy_plateau(20))
    assert g.decide(20, 0.5, 1.0) == "ok"
    assert g.loss_spikes == 0


def test_no_judgement_during_warmup():
    g = guard(spike="skip", spike_window=50)
    assert feed(g, [3.0] * 9 + [100.0]) == ["ok"] * 10  # 9 losses of history < the warm-up of 10
    assert g.decide(10, 100.0, 1.0) == "skip"  # 10 accepted now (the first 100.0 among them): median 3.0


def test_spike_off_never_flags():
    g = guard(spike="off")
    assert feed(g, noisy_plateau(30) + [1e6]) == ["ok"] * 31
    assert g.spike_zscore(1e6) is None


def test_no_spike_on_a_smooth_decreasing_curve_with_noise():
    rng = random.Random(1)
    curve = [2.0 + 8.0 * math.exp(-t / 150) + rng.gauss(0, 0.03) for t in range(2000)]
    g = guard(spike="skip", spike_window=50, spike_zscore=6.0)
    assert feed(g, curve) == ["ok"] * len(curve)
    assert g.loss_spikes == 0


def test_flat_history_mad_zero_does_not_divide_by_zero():
    g = guard(spike="skip", spike_window=10)
    feed(g, [2.0] * 10)
    assert g.spike_zscore(2.0) == 0.0
    assert g.decide(10, 2.0, 1.0) == "ok"
    assert g.decide(11, 2.001, 1.0) == "ok"  # within the 0.1%-of-median floor on the scale
    assert g.decide(12, 3.0, 1.0) == "skip"


def test_zero_loss_history_does_not_divide_by_zero():
    g = guard(spike="warn", spike_window=10)
    feed(g, [0.0] * 10)
    assert math.isfinite(g.spike_zscore(1.0))


def test_state_round_trip_keeps_counters_and_history():
    g = guard(spike="skip", nonfinite="skip", spike_window=20, max_consecutive_skips=5)
    feed(g, noisy_plateau(20) + [NAN])
    restored = guard(spike="skip", nonfinite="skip", spike_window=20, max_consecutive_skips=5)
    restored.load_state_dict(g.state_dict())
    assert restored.state_dict() == g.state_dict()
    assert restored.decide(21, 5.0, 1.0) == "skip" and restored.consecutive_skips == 2


def test_agreed_values_in_one_process_are_the_local_ones():
    loss, norm = torch.tensor(2.5), torch.tensor(0.75)
    assert agreed_values(loss, norm) == (2.5, 0.75)
    values = agreed_values(torch.tensor(1.2345678, dtype=torch.float32), torch.tensor(3.3, dtype=torch.bfloat16))
    assert values == (float(torch.tensor(1.2345678)), float(torch.tensor(3.3, dtype=torch.bfloat16)))
    assert all(isinstance(v, float) for v in values)


def test_agreed_values_keep_nan_and_inf():
    loss, norm = agreed_values(torch.tensor(NAN), torch.tensor(INF))
    assert math.isnan(loss) and math.isinf(norm)


@pytest.mark.dist
def test_agreed_values_over_a_process_group_of_one():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert agreed_values(torch.tensor(2.0, requires_grad=True) * 1, torch.tensor(0.5)) == (2.0, 0.5)
    finally:
        dist.destroy_process_group()


def test_nan_fault_poisons_loss_and_gradients_at_that_step_only():
    # The test-side fault (tests/faults) through the worker's on_loss hook: the training loss of step 5 (1-based).
    weight = torch.ones(3, requires_grad=True)
    targets = torch.tensor([[0, 1]])
    on_loss = worker_faults.hooks_of({"nan_at_step": 5}).on_loss

    def loss_at(step):  # what train_step builds for `step` (0-based): a TokenLoss adjusted by the step's hook
        return TokenLoss(2, functools.partial(on_loss, step))((weight * 2).expand(1, 2, 3), targets)

    clean = TokenLoss(2)((weight * 2).expand(1, 2, 3), targets)
    assert torch.equal(loss_at(3), clean) and torch.equal(loss_at(5), clean)  # steps 4 and 6
    poisoned = loss_at(4)  # step 5
    assert math.isnan(poisoned.item())
    poisoned.backward()
    assert torch.isnan(weight.grad).all()


def test_agreed_step_copies_nothing_from_the_host():
    """Every value is built on the loss's device: torch.tensor(python value, device=...) is a blocking
    host-to-device copy on CUDA (lift_fresh + copy), which would add a host sync to every step."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func) + ("(device)" if (kwargs or {}).get("device") is not None else ""))
            return func(*args, **(kwargs or {}))

    loss, norm = torch.tensor(1.5), torch.tensor(0.25)
    with Ops() as ops:
        assert agreed_step(loss, norm, stop=True) == (1.5, 0.25, True)
    # lift_fresh is a tensor made from Python data; a copy given a device moves data between devices.
    assert not [op for op in ops.seen if "lift_fresh" in op or ("copy" in op and "(device)" in op)], ops.seen


def test_empty_batches_are_counted_warned_and_survive_a_resume(caplog):
    g = StepGuard(GuardsConfig())
    with caplog.at_level(logging.WARNING, logger="trainctl.train"):
        g.note_empty(4)
        g.note_empty(9)
    assert g.metrics()["guard_empty_batches"] == 2 and "step 9: skipped" in caplog.text
    restored = StepGuard(GuardsConfig())
    restored.load_state_dict(g.state_dict())
    assert restored.metrics() == g.metrics()
    older = {k: v for k, v in g.state_dict().items() if k != "empty_batches"}  # a checkpoint from before masks
    restored.load_state_dict(older)
    assert restored.metrics()["guard_empty_batches"] == 0
