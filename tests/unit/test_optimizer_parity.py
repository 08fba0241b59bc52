"""Each optimizer optim.name builds steps as its reference does, in one process, fp32, over 10 steps: torch's
own class where one exists (SGD, Muon with AdamW, torchao's low-bit AdamW) bitwise, since the same kernels run on
the same gradients; Lion against the paper's update written plainly here, to rounding's bound. torchao's low-bit
AdamWs also hold the state bytes the plan counts and resume bitwise through the worker's checkpoint."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from tests.helpers import assert_close_fp
from trainctl.config.schema import ModelConfig, OptimConfig, ShardingConfig
from trainctl.core.dims import ParallelDims
from trainctl.models.build import build_model
from trainctl.plan import rank_states
from trainctl.plan.stages import rank_stages
from trainctl.train.checkpoint.state import app_state
from trainctl.train.checkpoint.store import CheckpointManager
from trainctl.train.observe.memory_stats import model_state_bytes
from trainctl.train.optim import build_optimizer

# Small enough for a unit test (Muon's Newton-Schulz runs bf16 matmuls, slow on a CPU), large enough to have every
# kind of parameter: hidden matrices, embedding, output, norms.
SMALL = ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=48, vocab_size=64, max_seq_len=32)
STEPS = 10


def model_pair(model_cfg: ModelConfig = SMALL) -> tuple[nn.Module, nn.Module]:
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        model = build_model(model_cfg, "cpu")
        model.init_weights()
        models.append(model)
    return models[0], models[1]


def groups(model: nn.Module) -> tuple[list, list, list]:
    """(hidden matrices, embedding and output, norms), by the module, not by trainctl's code."""
    hidden = [p for name, p in model.named_parameters() if p.ndim == 2 and name.startswith("layers.")]
    ends = [model.tok_embeddings.weight, model.output.weight]
    norms = [p for p in model.parameters() if p.ndim == 1]
    return hidden, ends, norms


def train_both(ours: nn.Module, opt: torch.optim.Optimizer, ref: nn.Module, step_ref) -> None:
    """The same gradients into both models each step (ours computes them), then each optimizer steps."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        tokens = torch.randint(0, 64, (2, 16), generator=gen)
        ours(tokens).float().square().mean().backward()
        for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
            b.grad = a.grad.clone()
        opt.step()
        step_ref()
        opt.zero_grad()
        for p in ref.parameters():
            p.grad = None


def assert_equal_models(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_sgd_is_torchs_sgd_with_momentum_nesterov_and_decay_on_matrices_only():
    ours, ref = model_pair()
    cfg = OptimConfig(name="sgd", lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1)
    opt = build_optimizer(ours, cfg, "cpu")
    hidden, ends, norms = groups(ref)
    reference = torch.optim.SGD([{"params": hidden + [ref.output.weight], "weight_decay": 0.1},
                                 {"params": [ref.tok_embeddings.weight] + norms, "weight_decay": 0.0}],
                                lr=0.05, momentum=0.9, nesterov=True)
    train_both(ours, opt, ref, reference.step)
    assert_equal_models(ours, ref)


def test_muon_is_torchs_muon_on_hidden_matrices_and_adamw_on_the_rest():
    ours, ref = model_pair()
    cfg = OptimConfig(name="muon", lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1, beta1=0.9, beta2=0.95)
    opt = build_optimizer(ours, cfg, "cpu")
    hidden, ends, norms = groups(ref)
    muon = torch.optim.Muon(hidden, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True,
                            adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([{"params": [ref.output.weight], "weight_decay": 0.1},
                               {"params": [ref.tok_embeddings.weight] + norms, "weight_decay": 0.0}],
                              lr=0.02, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    train_both(ours, opt, ref, lambda: (muon.step(), adamw.step()))
    assert_equal_models(ours, ref)
    assert len(opt.state) == len(list(ours.parameters()))  # one state per parameter, Muon's or AdamW's


def test_lion_is_the_papers_update():
    """Chen et al. 2023, Algorithm 2: c = b1 m + (1 - b1) g; p -= lr (sign(c) + wd p); m = b2 m + (1 - b2) g."""
    ours, ref = model_pair()
    lr, b1, b2, wd = 1e-3, 0.9, 0.99, 0.5
    opt = build_optimizer(ours, OptimConfig(name="lion", lr=lr, beta1=b1, beta2=b2, weight_decay=wd), "cpu")
    hidden, ends, norms = groups(ref)
    decayed = {id(p) for p in hidden + [ref.output.weight]}
    moments = {id(p): torch.zeros_like(p) for p in ref.parameters()}

    @torch.no_grad()
    def paper_step():
        for p in ref.parameters():
            m, g = moments[id(p)], p.grad
            c = b1 * m + (1 - b1) * g
            p -= lr * (torch.sign(c) + (wd if id(p) in decayed else 0.0) * p)
            moments[id(p)] = b2 * m + (1 - b2) * g

    train_both(ours, opt, ref, paper_step)
    for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
        # Per step a few roundings of p (decay, the signed step) in each; a sign that rounding flips is lr away,
        # which needs |c| within a rounding of 0: the seed's gradients have none.
        assert_close_fp(p.detach(), q.detach(), torch.float32, terms=3 * STEPS, what=name)
    assert max((p - q).abs().max() for p, q in zip(ours.parameters(), ref.parameters(), strict=True)) <= 1e-6


LOW_BIT = {"adamw8bit": "AdamW8bit", "adamw4bit": "AdamW4bit", "adamwfp8": "AdamWFp8"}
# 64 x 64 matrices: quantized (>= 4096 elements, whole blocks); 32 x 64 (wk, wv) and the norms keep fp32 moments.
# One model for every low-bit test: torchao compiles its step per shape, and the session reuses what it compiled.
LOW_BIT_MODEL = dataclasses.replace(SMALL, dim=64, ffn_dim=64)


def low_bit_config(name: str) -> OptimConfig:
    return OptimConfig(name=name, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


# torchao compiles its step per tensor shape (Inductor runs a C++ compiler): a `dist` test by cost, not a `unit` one.
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("name", list(LOW_BIT))
def test_low_bit_adamw_is_torchaos_class(name):
    torchao_optim = pytest.importorskip("torchao.optim")
    ours, ref = model_pair(LOW_BIT_MODEL)
    cfg = low_bit_config(name)
    opt = build_optimizer(ours, cfg, "cpu")
    hidden, ends, norms = groups(ref)
    reference = getattr(torchao_optim, LOW_BIT[name])(
        [{"params": hidden + [ref.output.weight], "weight_decay": 0.1},
         {"params": [ref.tok_embeddings.weight] + norms, "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    train_both(ours, opt, ref, reference.step)
    assert_equal_models(ours, ref)
    assert type(opt).__name__ == LOW_BIT[name]


def trained(cfg: OptimConfig, seed: int, steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = build_model(LOW_BIT_MODEL, "cpu")
    model.init_weights()
    opt = build_optimizer(model, cfg, "cpu")
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randint(0, LOW_BIT_MODEL.vocab_size, (2, 16), generator=gen)).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def step_both(a: nn.Module, opt_a: torch.optim.Optimizer, b: nn.Module, opt_b: torch.optim.Optimizer) -> None:
    """One step of each on the same gradients (a's)."""
    tokens = torch.randint(0, LOW_BIT_MODEL.vocab_size, (2, 16), generator=torch.Generator().manual_seed(7))
    a(tokens).float().square().mean().backward()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        q.grad = p.grad.clone()
    opt_a.step()
    opt_b.step()


def plain(value: torch.Tensor) -> torch.Tensor:
    """A state tensor's values: torchao's quantized subclasses dequantized (their codes and scales, decoded)."""
    return value.dequantize() if hasattr(value, "dequantize") else value


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, as a one-rank run saves
@pytest.mark.parametrize("name", list(LOW_BIT))
def test_low_bit_adamw_holds_the_planned_state_and_resumes_bitwise(name, tmp_path):
    """After 3 steps the live state (memory_stats: codes, scales and code maps) is the plan's state bytes; the
    worker's checkpoint (DCP through checkpoint/state.app_state) loads into a fresh model and optimizer (another
    seed's), and the next step on both is the same bit for bit, parameters and moments."""
    pytest.importorskip("torchao.optim")
    cfg = low_bit_config(name)
    ours, opt = trained(cfg, seed=0, steps=3)
    sharding = ShardingConfig()
    (stage,) = rank_stages(LOW_BIT_MODEL, sharding, 1)
    planned = rank_states.model_states(LOW_BIT_MODEL, sharding, ParallelDims(), stage, 0, optim=name)
    adamw = rank_states.model_states(LOW_BIT_MODEL, sharding, ParallelDims(), stage, 0, optim="adamw")
    assert model_state_bytes(ours, opt)["optimizer_bytes"] == planned["optimizer_bytes"] < adamw["optimizer_bytes"]

    manager = CheckpointManager(tmp_path, keep_last=1)
    manager.save(3, app_state(ours, opt), {}, {})
    resumed, resumed_opt = trained(cfg, seed=1, steps=0)
    allowed = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()  # as a library's load can leave it (accelerate's): the load allows them
    try:
        manager.load(manager.latest_valid(), app_state(resumed, resumed_opt))
    finally:
        torch.serialization.add_safe_globals(allowed)
    step_both(ours, opt, resumed, resumed_opt)
    assert_equal_models(ours, resumed)
    for p, q in zip(ours.parameters(), resumed.parameters(), strict=True):
        mine, theirs = opt.state[p], resumed_opt.state[q]
        assert mine.keys() == theirs.keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key in mine:
            assert type(mine[key]) is type(theirs[key]) and torch.equal(plain(mine[key]), plain(theirs[key])), key
