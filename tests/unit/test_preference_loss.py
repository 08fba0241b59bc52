"""Preference tuning in one process: DPO's and SimPO's losses and gradients against the papers' formulas written
plainly in float64, the reference as the base with LoRA's adapters off, pairs that never leave their micro-batch,
and a tiny model that learns to prefer one kind of answer (accuracy ~50% -> > 95%)."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest
import torch

from tests.helpers import assert_close_fp
from trainctl.config.schema import DataConfig, LoRAConfig, ModelConfig, PrecisionConfig, ShardingConfig, TrainConfig
from trainctl.core import objectives
from trainctl.core.wrapping import wrapping_of
from trainctl.data.chat import RecordOptions
from trainctl.data.prepare import prepare
from trainctl.models.build import build_model
from trainctl.models.loss_head import IGNORE_INDEX
from trainctl.train.loop.micro_batch import MicroBatchContext
from trainctl.train.preference import losses
from trainctl.train.preference.objective import PreferenceObjective
from trainctl.train.preference.pairs import PairBatches
from trainctl.train.preference.reference import adapters_off

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, no group: as meant

PAIRS, SEQ, VOCAB = 3, 7, 11


def logits_and_targets(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logits of 2 * PAIRS rows (chosen rows first) and targets with prompts and padding ignored."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(2 * PAIRS, SEQ, VOCAB, generator=gen) * 3
    targets = torch.randint(0, VOCAB, (2 * PAIRS, SEQ), generator=gen)
    for row in range(2 * PAIRS):
        prompt, pad = row % 3, (row * 2) % 3
        targets[row, :prompt] = IGNORE_INDEX
        targets[row, SEQ - pad:] = IGNORE_INDEX
    return logits, targets


def plain_logps(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(y|x) = sum over the answer's tokens of log softmax(logits)[target], in float64; and |y|."""
    counted = targets != IGNORE_INDEX
    logp = torch.log_softmax(logits.double(), dim=-1)
    picked = torch.gather(logp, -1, targets.clamp(min=0)[..., None])[..., 0]
    return (picked * counted).sum(-1), counted.sum(-1).double()


def dpo_by_the_paper(policy: torch.Tensor, ref: torch.Tensor, targets: torch.Tensor, beta: float, eps: float):
    """Rafailov et al. eq. 7, with cDPO's label smoothing eps; the mean over pairs."""
    pi, _ = plain_logps(policy, targets)
    rf, _ = plain_logps(ref, targets)
    h = beta * ((pi[:PAIRS] - pi[PAIRS:]) - (rf[:PAIRS] - rf[PAIRS:]))
    sig = 1 / (1 + torch.exp(-h))
    return (-(1 - eps) * torch.log(sig) - eps * torch.log(1 - sig)).mean()


def simpo_by_the_paper(policy: torch.Tensor, targets: torch.Tensor, beta: float, gamma: float):
    """Meng et al. eq. 6: length-normalized log-probabilities, a target margin gamma; the mean over pairs."""
    pi, n = plain_logps(policy, targets)
    h = beta * pi[:PAIRS] / n[:PAIRS] - beta * pi[PAIRS:] / n[PAIRS:] - gamma
    return -torch.log(1 / (1 + torch.exp(-h))).mean()


def ours(objective: str, policy: torch.Tensor, ref: torch.Tensor, targets: torch.Tensor, **k) -> torch.Tensor:
    logps, counts = losses.sequence_logps(policy, targets)
    if objective == "dpo":
        ref_logps, _ = losses.sequence_logps(ref, targets)
        out = losses.dpo(logps[:PAIRS], logps[PAIRS:], ref_logps[:PAIRS], ref_logps[PAIRS:], k["beta"], k["eps"])
    else:
        out = losses.simpo(logps[:PAIRS], logps[PAIRS:], counts[:PAIRS], counts[PAIRS:], k["beta"], k["gamma"])
    return out.losses.mean()


# The chain of one loss: a log-sum-exp over the vocabulary, a sum over the sequence, the pair's difference of
# four sums, a log-sigmoid, and a mean over the pairs; the gradient retraces it.
TERMS = VOCAB + SEQ + 4 + 4 + PAIRS


@pytest.mark.parametrize("objective,knobs", [("dpo", {"beta": 0.1, "eps": 0.0}), ("dpo", {"beta": 0.5, "eps": 0.2}),
                                             ("simpo", {"beta": 2.0, "gamma": 0.5})])
def test_loss_and_gradients_equal_the_papers_formula(objective, knobs):
    logits, targets = logits_and_targets()
    ref = logits_and_targets(seed=1)[0]
    mine = logits.clone().requires_grad_(True)
    plain = logits.double().requires_grad_(True)
    got = ours(objective, mine, ref, targets, **knobs)
    want = (dpo_by_the_paper(plain, ref, targets, **knobs) if objective == "dpo"
            else simpo_by_the_paper(plain, targets, **knobs))
    got.backward()
    want.backward()
    assert_close_fp(got.detach(), want.detach(), torch.float32, TERMS, sides=1, what=f"{objective} loss")
    assert plain.grad.abs().sum() > 0  # the comparison below compares something
    assert_close_fp(mine.grad, plain.grad, torch.float32, 2 * TERMS, sides=1, what=f"{objective} d loss / d logits")


def test_a_reference_equal_to_the_policy_gives_log_2():
    logits, targets = logits_and_targets()
    loss = ours("dpo", logits, logits, targets, beta=0.1, eps=0.0)
    assert_close_fp(loss, torch.log(torch.tensor(2.0)), torch.float32, TERMS, sides=1)


TINY = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=256, max_seq_len=128)


def test_adapters_off_is_the_base_model():
    model = build_model(TINY.__class__(**{**TINY.__dict__, "lora": LoRAConfig(rank=4)}), "cpu")
    torch.manual_seed(0)
    model.init_weights()
    for name, param in model.named_parameters():
        if "lora_" in name:
            torch.nn.init.normal_(param.data)  # B nonzero: the adapters change the output
    base = copy.deepcopy(model)
    for m in base.modules():
        if hasattr(m, "lora_b"):
            m.lora_b.data.zero_()
    tokens = torch.randint(0, 256, (2, 16))
    assert not torch.allclose(model(tokens), base(tokens))
    with adapters_off(model):
        assert torch.equal(model(tokens), base(tokens))
    assert not torch.allclose(model(tokens), base(tokens))  # switched back on


def preference_set(root: Path, pairs: int = 200, seed: int = 0) -> Path:
    """Digit prompts; the chosen answer is always letters from a-e, the rejected one from v-z (random lengths)."""
    rng = random.Random(seed)

    def word(letters: str) -> str:
        return "".join(rng.choices(letters, k=rng.randint(2, 6)))

    lines = [json.dumps({"prompt": word("0123456789"), "chosen": word("abcde"), "rejected": word("vwxyz")})
             for _ in range(pairs)]
    (root / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    prepare([str(root / "pairs.jsonl")], root / "pairs", workers=1, val_fraction=0.2, chat_template="chatml",
            records=RecordOptions("preference"))
    return root / "pairs"


# A ChatML answer document of these words is 66..74 bytes: rows of 65 keep every answer's letters and cut the
# end-of-turn tail of most (counted, and warned by the worker: pairs.PairTable).
SEQ_LEN = 64


def pair_batches(data: Path, split: str, micro: int, accum: int = 1, dp_rank: int = 0, dp: int = 1) -> PairBatches:
    cfg = DataConfig(kind="memmap", datasets=[str(data)], vocab_size=256)
    return PairBatches(cfg, split, SEQ_LEN, micro * accum * dp, micro, accum, dp_rank, dp, seed=5)


def test_pairs_stay_whole_and_ranks_split_the_global_batch(tmp_path):
    data = preference_set(tmp_path, pairs=40)
    one = pair_batches(data, "train", micro=4, accum=2).micro_batches(3)
    halves = [pair_batches(data, "train", micro=4, dp_rank=r, dp=2).micro_batches(3)[0] for r in (0, 1)]
    for whole, half in zip(one, halves, strict=True):  # rank r holds what micro-batch r of one process held
        assert torch.equal(whole[0], half[0]) and torch.equal(whole[1], half[1])
    for inputs, targets in one:
        assert inputs.shape == targets.shape == (8, SEQ_LEN)
        for i in range(4):  # row i and row 4 + i: one pair, one prompt, the chosen answer from a-e
            chosen, rejected = (bytes(inputs[r].tolist()).split(b"<|im_start|>assistant")[0] for r in (i, 4 + i))
            assert chosen == rejected
            answer = bytes(t for t in targets[i].tolist() if t != IGNORE_INDEX).split(b"<")[0]
            assert answer and set(answer) <= set(b"abcde")


def preferred_share(model, batches) -> float:
    """Share of held-out pairs whose chosen answer the model finds likelier than the rejected one."""
    wins = total = 0
    with torch.no_grad():
        for inputs, targets in batches:
            logps, _ = losses.sequence_logps(model(inputs), targets)
            half = len(logps) // 2
            wins, total = wins + int((logps[:half] > logps[half:]).sum()), total + half
    return wins / total


@pytest.fixture
def one_thread():
    """Tiny matmuls: a second intra-op thread only waits for the first (and, on a busy machine, for a core)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_a_tiny_model_learns_to_prefer_the_chosen_answers(tmp_path, one_thread):
    torch.manual_seed(0)
    data = preference_set(tmp_path)
    model = build_model(TINY, "cpu")
    model.init_weights()
    train = TrainConfig(objective="dpo", dpo_beta=0.5)
    objective = PreferenceObjective(train, reference=copy.deepcopy(model).requires_grad_(False))
    contexts = MicroBatchContext(model, PrecisionConfig(), wrapping_of(ShardingConfig(), PrecisionConfig()),
                                 torch.device("cpu"))
    held_out = pair_batches(data, "val", micro=8).eval_batches(4)
    before = preferred_share(model, held_out)
    assert 0.2 <= before <= 0.8, before  # no preference before training
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = pair_batches(data, "train", micro=8)
    for step in range(15):  # ~100% by step 10 on this set
        objective.forward_backward(model, batches.micro_batches(step), contexts)
        optimizer.step()
        optimizer.zero_grad()
    assert preferred_share(model, held_out) > 0.95
    assert objective.last["reward_accuracy"] > 0.95 and objective.last["reward_margin"] > 0
    loss, pairs = objective.evaluate(model, held_out, contexts)
    assert pairs == 32 and loss < 0.3 and objective.last_eval["reward_accuracy"] > 0.95
    held_out_metrics = objective.eval_metrics()  # what the eval record carries: the pair metrics, nothing else
    assert held_out_metrics.keys() == set(objectives.PAIR_METRICS)
    assert held_out_metrics["reward_accuracy"] == objective.last_eval["reward_accuracy"]


def test_the_frozen_reference_copies_the_policy_and_stays_frozen():
    from trainctl.config.schema import RunConfig
    from trainctl.train.preference.reference import copy_weights, frozen_copy

    cfg = RunConfig(model=TINY)
    policy = build_model(TINY, "cpu")
    policy.init_weights()
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(torch.randn_like(param))  # a policy that moved away from the seeded init
    reference = frozen_copy(cfg, None, torch.device("cpu"))
    tokens = torch.randint(0, 256, (2, 16))
    assert not torch.equal(reference(tokens), policy(tokens))
    copy_weights(reference, policy)
    assert torch.equal(reference(tokens), policy(tokens))
    assert not any(p.requires_grad for p in reference.parameters()) and not reference.training
