"""Training on masked (chat) data: the batches ignore every target outside the answers, and the loss is the mean
over the counted targets only (by hand on one batch), through the chunked head and the dense loss alike."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.helpers import assert_close_fp, step_terms
from trainctl.config.schema import DataConfig, ModelConfig
from trainctl.data.chat import RecordOptions
from trainctl.data.prepare import prepare
from trainctl.models.build import build_model
from trainctl.models.loss_head import IGNORE_INDEX
from trainctl.train.loop.data import TokenBatches
from trainctl.train.loop.loss import TokenLoss, counted_targets, step_divisor
from trainctl.train.loop.sources import DataError

ANSWER = "The answer is fixed."  # no digit in it: prompts are digits only
TINY = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=256, max_seq_len=64)


def chat_set(root: Path, records: int = 60, seed: int = 0) -> Path:
    """Random digit prompts, one fixed answer, prepared with the byte tokenizer and ChatML."""
    rng = random.Random(seed)
    lines = [json.dumps({"messages": [{"role": "user", "content": "".join(rng.choices("0123456789", k=rng.randint(
        5, 40)))}, {"role": "assistant", "content": ANSWER}]}) for _ in range(records)]
    (root / "chat.jsonl").write_text("\n".join(lines) + "\n")
    prepare([str(root / "chat.jsonl")], root / "chat", workers=1, val_fraction=0.1, chat_template="chatml",
            records=RecordOptions("chat"))
    return root / "chat"


def batches(out: Path, seq_len: int = 32, split: str = "train", micro: int = 2, accum: int = 2) -> TokenBatches:
    cfg = DataConfig(kind="memmap", datasets=[str(out)], vocab_size=256)
    return TokenBatches(cfg, split, seq_len, micro * accum, micro, accum, 0, 1, seed=3)


def test_only_answer_targets_count(tmp_path):
    data = batches(chat_set(tmp_path))
    assert data.masked
    digits = torch.tensor([ord(c) for c in "0123456789"])
    answer_bytes = torch.tensor(sorted(set((ANSWER + "<|im_end|>\n").encode())))
    counted = prompts = 0
    for step in range(20):
        for inputs, targets in data.micro_batches(step):
            valid = targets != IGNORE_INDEX
            assert not torch.isin(targets[valid], digits).any()  # a prompt token never counts
            assert not valid[targets == 0].any()  # nor the EOS appended after a conversation
            assert torch.isin(targets[valid], answer_bytes).all()  # only the answer and its end of turn
            prompt = torch.isin(inputs[:, 1:], digits)  # the targets of positions 0..seq-2 are the inputs 1..seq-1
            assert (targets[:, :-1][prompt] == IGNORE_INDEX).all()
            counted, prompts = counted + int(valid.sum()), prompts + int(prompt.sum())
    assert counted > 0 and prompts > 0


@pytest.mark.parity
def test_masked_loss_equals_hand_computation(tmp_path):
    data = batches(chat_set(tmp_path), micro=4, accum=1)
    (inputs, targets), = data.micro_batches(0)
    torch.manual_seed(0)
    model = build_model(TINY, "cpu")
    model.init_weights()
    divisor = step_divisor([(inputs, targets)], cp=1, device=torch.device("cpu"))
    assert divisor == counted_targets([(inputs, targets)]) == int((targets != IGNORE_INDEX).sum()) > 0
    chunked = TokenLoss(divisor).of_model(model, inputs, targets)
    dense = TokenLoss(divisor)(model(inputs), targets)
    log_probs = F.log_softmax(model(inputs).double(), dim=-1)
    by_hand = [-log_probs[b, t, targets[b, t]] for b in range(targets.shape[0]) for t in range(targets.shape[1])
               if targets[b, t] != IGNORE_INDEX]
    want = torch.stack(by_hand).mean()
    # Against float64 on the same body: the head (dim), the log-softmax (vocab) and the mean (tokens) round.
    terms = TINY.dim + TINY.vocab_size + divisor
    assert_close_fp(chunked.double(), want, torch.float32, terms, what="chunked")
    assert_close_fp(dense.double(), want, torch.float32, terms, what="dense")
    unmasked = TokenLoss(targets.numel())(model(inputs), torch.where(targets == IGNORE_INDEX, inputs.roll(-1, 1),
                                                                            targets))
    assert abs(unmasked.item() - want.item()) > 1e-3  # the prompt tokens would change it: the test can fail


@pytest.mark.parity
def test_gradients_ignore_prompt_targets(tmp_path):
    data = batches(chat_set(tmp_path), micro=4, accum=1)
    (inputs, targets), = data.micro_batches(1)
    model = build_model(replace(TINY), "cpu")
    model.init_weights()
    loss = TokenLoss(counted_targets([(inputs, targets)])).of_model(model, inputs, targets)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    keep = targets != IGNORE_INDEX
    logits = model(inputs)
    F.cross_entropy(logits[keep].float(), targets[keep], reduction="mean").backward()
    terms = step_terms(TINY, inputs.shape[1], int(keep.sum()))
    for i, (got, want) in enumerate(zip(grads, [p.grad for p in model.parameters()], strict=True)):
        assert_close_fp(got, want, torch.float32, terms, what=f"gradient {i}")


def test_unmasked_data_keeps_every_target(tmp_path):
    (tmp_path / "a.txt").write_text("plain text, every token counts. " * 40)
    prepare([str(tmp_path / "a.txt")], tmp_path / "text", workers=1, val_fraction=0)
    data = batches(tmp_path / "text")
    assert not data.masked
    assert all((t != IGNORE_INDEX).all() for _, t in data.micro_batches(0))


def test_mask_of_another_length_is_refused_by_the_worker(tmp_path):
    out = chat_set(tmp_path)
    mask = out / "train-00000.mask"
    mask.write_bytes(mask.read_bytes() + b"\x01")
    with pytest.raises(DataError, match="mask file train-00000.mask is .* bytes, its shard has"):
        batches(out)


def test_blend_of_masked_and_plain_counts_every_plain_target(tmp_path):
    out = chat_set(tmp_path)
    (tmp_path / "a.txt").write_text("0123456789 " * 400)
    prepare([str(tmp_path / "a.txt")], tmp_path / "text", workers=1, val_fraction=0)
    cfg = DataConfig(kind="memmap", datasets=[str(out), str(tmp_path / "text")], vocab_size=256)
    data = TokenBatches(cfg, "train", 32, 16, 16, 1, 0, 1, seed=0)
    (inputs, targets), = data.micro_batches(0)
    digits = torch.isin(inputs, torch.tensor([ord(c) for c in "0123456789"]))
    plain_rows = [r for r in range(16) if digits[r].all() or (digits[r].sum() > 20 and (inputs[r] == 32).any()
                                                                and not (inputs[r] == ord("<")).any())]
    assert plain_rows and all((targets[r] != IGNORE_INDEX).all() for r in plain_rows)
    assert np.any([(targets[r] == IGNORE_INDEX).any() for r in range(16)])


def test_one_row_micro_batches_keep_their_inputs(tmp_path):
    """With one row, the targets slice is a view overlapping the inputs: masking must not write into the inputs."""
    data = batches(chat_set(tmp_path), micro=1, accum=4)
    pairs = [pair for step in range(5) for pair in data.micro_batches(step)]
    assert any((targets == IGNORE_INDEX).any() for _, targets in pairs)
    assert all((inputs >= 0).all() for inputs, _ in pairs)
