"""LR schedules (shape at warmup end, midpoint, last step, monotonic, floor) and AdamW groups."""

import math

import pytest
import torch

from trainctl.config.schema import ModelConfig, OptimConfig, ScheduleConfig
from trainctl.models.build import build_model
from trainctl.train.errors import WorkerConfigError
from trainctl.train.optim import build_optimizer, lr_at, param_groups

LR, STEPS, WARMUP, FLOOR = 1e-3, 110, 10, 0.1


def schedule(name: str, **kw) -> ScheduleConfig:
    return ScheduleConfig(name=name, warmup_steps=WARMUP, min_lr_ratio=FLOOR, **kw)


def curve(s: ScheduleConfig, steps: int = STEPS) -> list[float]:
    return [lr_at(i, LR, s, steps) for i in range(steps)]


@pytest.mark.parametrize("name", ["constant", "linear", "cosine", "wsd"])
def test_warmup_rises_linearly_from_near_zero_to_peak(name):
    lrs = curve(schedule(name))
    assert lrs[0] == pytest.approx(LR / WARMUP)
    assert lrs[WARMUP - 1] == pytest.approx(LR)
    assert all(b > a for a, b in zip(lrs[:WARMUP], lrs[1:WARMUP], strict=False))
    steps = [b - a for a, b in zip(lrs[: WARMUP - 1], lrs[1:WARMUP], strict=False)]
    assert max(steps) == pytest.approx(min(steps))


@pytest.mark.parametrize("name", ["linear", "cosine", "wsd"])
def test_decay_is_monotonic_and_ends_on_the_floor(name):
    lrs = curve(schedule(name))
    after = lrs[WARMUP - 1 :]
    assert all(b <= a + 1e-15 for a, b in zip(after, after[1:], strict=False))
    assert lrs[-1] == pytest.approx(FLOOR * LR)
    assert min(lrs[WARMUP:]) >= FLOOR * LR - 1e-15


def test_constant_stays_at_peak():
    assert curve(schedule("constant"))[WARMUP:] == [LR] * (STEPS - WARMUP)


def test_linear_and_cosine_midpoints():
    mid = (WARMUP + STEPS - 1) // 2
    progress = (mid - WARMUP) / (STEPS - 1 - WARMUP)
    lin = lr_at(mid, LR, schedule("linear"), STEPS)
    cos = lr_at(mid, LR, schedule("cosine"), STEPS)
    assert lin == pytest.approx(FLOOR * LR + (1 - FLOOR) * LR * (1 - progress))
    assert cos == pytest.approx(FLOOR * LR + (1 - FLOOR) * LR * 0.5 * (1 + math.cos(math.pi * progress)))
    # Cosine stays above the straight line in the first half of the decay.
    assert cos > lin


def test_wsd_holds_then_decays_over_the_last_fraction():
    lrs = curve(schedule("wsd", decay_fraction=0.2))
    decay_steps = round(0.2 * STEPS)  # 22
    start = STEPS - 1 - decay_steps
    assert lrs[WARMUP:start + 1] == [LR] * (start + 1 - WARMUP)
    assert lrs[start + 1] < LR
    half = start + decay_steps // 2
    assert lrs[half] == pytest.approx(FLOOR * LR + (1 - FLOOR) * LR * 0.5)


def test_no_warmup_starts_at_peak():
    s = ScheduleConfig(name="cosine", warmup_steps=0, min_lr_ratio=0.0)
    assert lr_at(0, LR, s, 50) == pytest.approx(LR)
    assert lr_at(49, LR, s, 50) == pytest.approx(0.0, abs=1e-12)


def test_unknown_schedule_raises_our_error():
    with pytest.raises(WorkerConfigError, match="schedule.name"):
        lr_at(20, LR, ScheduleConfig(name="step"), 100)


def _small_model(tie: bool = False):
    cfg = ModelConfig(dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=24, vocab_size=32, max_seq_len=8,
                      tie_embeddings=tie)
    model = build_model(cfg, device="cpu")
    model.init_weights()
    return model


@pytest.mark.parametrize("tie", [False, True])
def test_norms_biases_and_embeddings_are_not_decayed(tie):
    model = _small_model(tie)
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    decayed = {id(p) for p in decay["params"]}
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(p.ndim >= 2 for p in decay["params"])
    assert all("norm" not in names[i] and "tok_embeddings" not in names[i] for i in decayed)
    assert id(model.layers["0"].attention.wq.weight) in decayed
    assert (id(model.output.weight) in decayed) is (not tie)
    # Every parameter is in exactly one group.
    total = len(decay["params"]) + len(no_decay["params"])
    assert total == len(list(model.parameters()))


def test_optimizer_uses_config_and_steps():
    model = _small_model()
    opt = build_optimizer(model, OptimConfig(lr=2e-3, beta1=0.8, beta2=0.9, weight_decay=0.05), "cpu")
    assert opt.param_groups[0]["betas"] == (0.8, 0.9) and opt.param_groups[0]["lr"] == 2e-3
    before = model.layers["0"].attention.wq.weight.detach().clone()
    model(torch.randint(0, 32, (2, 8))).sum().backward()
    opt.step()
    assert not torch.equal(before, model.layers["0"].attention.wq.weight)
