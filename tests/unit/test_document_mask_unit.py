"""data.document_mask: a packed row of documents gives each document the logits and loss it gets alone (fp32),
for every family; without positions the model runs the plain causal path it always ran."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from torch.nn import functional

from tests.helpers import assert_close_fp, forward_terms, step_terms
from trainctl.config.schema import ModelConfig
from trainctl.data.format import DOC_START, LOSS
from trainctl.models.build import build_model
from trainctl.models.common import rope
from trainctl.models.loss_head import IGNORE_INDEX
from trainctl.train.loop.data import document_positions, to_inputs_targets
from trainctl.train.loop.loss import token_loss_sum

BASE = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=97, max_seq_len=64)
FAMILIES = {
    "llama": BASE,
    "qwen3": replace(BASE, family="qwen3", head_dim=16),
    "qwen2": replace(BASE, family="qwen2"),
}
LENGTHS = (7, 12, 9)  # three documents packed in one row of 28 tokens


def _model(cfg: ModelConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(cfg, "cpu")
    model.init_weights()
    if cfg.family == "qwen2":  # zero-initialized biases would hide a bias that skipped the mask's path
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                torch.nn.init.normal_(p, std=0.5)
    return model.eval()


def _packed_row() -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """The documents, their packed row [1, 28] and its positions (restarting at each document)."""
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, BASE.vocab_size, (n,), generator=gen) for n in LENGTHS]
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    return docs, torch.cat(docs)[None], positions


@pytest.mark.parity
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_packed_row_gives_each_document_its_own_logits(family):
    model = _model(FAMILIES[family])
    docs, row, positions = _packed_row()
    with torch.no_grad():
        packed = model(row, positions=positions)[0]
        alone = torch.cat([model(doc[None])[0] for doc in docs])
        unmasked = model(row)[0]
    # The mask makes SDPA take another kernel than a document alone: rounding's bound.
    assert_close_fp(packed, alone, torch.float32, forward_terms(FAMILIES[family], row.shape[1]))
    # The documents after the first do see their predecessors without the mask: the test can tell.
    assert (unmasked[LENGTHS[0]:] - alone[LENGTHS[0]:]).abs().max() > 1e-2


@pytest.mark.parity
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_packed_row_gives_each_document_its_own_loss_and_gradients(family):
    model = _model(FAMILIES[family])
    docs, row, positions = _packed_row()
    targets = torch.cat([torch.cat([doc[1:], torch.tensor([IGNORE_INDEX])]) for doc in docs])[None]
    packed = token_loss_sum(model, row, targets, positions=positions)
    packed.backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    alone = sum(token_loss_sum(model, doc[None, :-1], doc[None, 1:]) for doc in docs)
    alone.backward()
    terms = step_terms(FAMILIES[family], row.shape[1], row.shape[1])  # one row: every token sums into the loss
    assert_close_fp(packed, alone, torch.float32, terms, what="loss")
    for i, (got, want) in enumerate(zip(packed_grads, [p.grad for p in model.parameters()], strict=True)):
        assert_close_fp(got, want, torch.float32, terms, what=f"gradient {i}")


def test_without_positions_attention_is_the_plain_causal_call(monkeypatch):
    """data.document_mask=false: no mask is built, SDPA gets is_causal=True as before (its fast kernels)."""
    calls = []
    real = functional.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        calls.append(sorted(kwargs.items(), key=lambda kv: kv[0]))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(functional, "scaled_dot_product_attention", spy)
    model = _model(BASE)
    _, row, positions = _packed_row()
    with torch.no_grad():
        model(row)
        assert calls == [[("enable_gqa", True), ("is_causal", True)]] * BASE.n_layers
        calls.clear()
        model(row, positions=positions)
    assert [dict(c).get("is_causal") for c in calls] == [None] * BASE.n_layers
    assert all(dict(c)["attn_mask"].shape == (1, 1, row.shape[1], row.shape[1]) for c in calls)


@pytest.mark.parity
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_rope_restarts_at_each_document(family, monkeypatch):
    """Logits barely tell restarted positions from running ones (RoPE is relative): compare the rotated q, k."""
    seen = []
    real = functional.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append((q, k))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(functional, "scaled_dot_product_attention", spy)
    model = _model(FAMILIES[family])
    docs, row, positions = _packed_row()
    start, end = LENGTHS[0], LENGTHS[0] + LENGTHS[1]
    with torch.no_grad():
        model(row, positions=positions)
        packed = seen[0]  # the first layer: its input is the embedding alone
        seen.clear()
        model(docs[1][None])
    terms = forward_terms(replace(FAMILIES[family], n_layers=1), row.shape[1])  # one block bounds its q and k
    for got, want in zip(packed, seen[0], strict=True):
        assert_close_fp(got[:, :, start:end], want, torch.float32, terms)


@pytest.mark.parity
def test_one_document_per_row_through_the_mask_equals_plain_causal():
    model = _model(BASE)
    _, row, _ = _packed_row()
    with torch.no_grad():
        plain = model(row)
        masked = model(row, positions=torch.arange(row.shape[1])[None])
    assert_close_fp(masked, plain, torch.float32, forward_terms(BASE, row.shape[1]))  # another SDPA kernel


def test_positions_restart_at_document_starts_and_at_each_row():
    flags = np.zeros((2, 8), np.uint8)
    flags[0, [0, 3]] = DOC_START
    flags[1, [5]] = DOC_START  # row 1 begins inside a document: its first token starts a segment
    assert document_positions(flags).tolist() == [[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 0, 1, 2]]


def test_a_target_that_starts_the_next_document_does_not_count():
    samples = np.arange(9, dtype=np.int64)[None]
    flags = np.full((1, 9), LOSS, np.uint8)
    flags[0, [0, 4]] |= DOC_START
    inputs, targets = to_inputs_targets(samples, flags)
    assert (targets != IGNORE_INDEX).all() and to_inputs_targets(samples, flags).positions is None
    batch = to_inputs_targets(samples, flags, document_mask=True)
    assert batch.positions.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert batch[1].tolist() == [[1, 2, 3, IGNORE_INDEX, 5, 6, 7, 8]]  # token 3 would predict document 2's first
    inputs, targets = batch  # unpacks as the pair every consumer reads
    assert torch.equal(inputs, torch.arange(8)[None])


def test_rope_of_per_token_positions_is_the_rotation_each_document_gets_alone():
    """RoPE is relative, so logits barely tell restarted from running positions: check the rotation itself."""
    freqs = rope.rope_frequencies(8, 64, 10000.0)
    x = torch.randn(1, 28, 2, 8)
    _, _, positions = _packed_row()
    packed = rope.apply_rope(x, freqs[positions])
    start = LENGTHS[0]
    assert torch.equal(packed[:, start:start + LENGTHS[1]], rope.apply_rope(x[:, start:start + LENGTHS[1]], freqs))


# ---------------------------------------------------------------- config: refused in one line each


@pytest.fixture(scope="module")
def chat_and_text(tmp_path_factory):
    from tests.unit.test_data_datasets import make_dataset
    from tests.unit.test_masked_loss import chat_set

    root = tmp_path_factory.mktemp("document-mask")
    return chat_set(root, records=80), make_dataset(root, "text", "a")


def _composed(*overrides: str):
    from trainctl.config.compose import compose
    from trainctl.config.validate import resolve

    return resolve(compose(["recipe=tiny_cpu", "train.seq_len=32", "model.vocab_size=256", *overrides]))


def test_chat_data_composes_with_document_mask(chat_and_text):
    chat, _ = chat_and_text
    cfg = _composed("data=memmap", f"data.datasets=[{chat}]", "data.document_mask=true")
    assert cfg.data.document_mask


@pytest.mark.parametrize(("overrides", "says"), [
    (("data=memmap", "data.datasets=[{text}]"), "marks no document starts (no mask files"),
    (("data=stdlib",), "data.kind=stdlib marks no document starts"),
    (("data=memmap", "data.datasets=[{chat}]", "sharding=fsdp", "sharding.pp=2", "model.n_layers=4"),
     "not implemented with sharding.pp=2"),
])
def test_what_document_mask_cannot_serve_is_refused_in_one_line(chat_and_text, overrides, says):
    from trainctl.config.errors import ConfigError

    chat, text = chat_and_text
    with pytest.raises(ConfigError) as err:
        _composed(*(o.format(chat=chat, text=text) for o in overrides), "data.document_mask=true")
    problems = [p for p in err.value.problems if "document_mask" in p]
    assert len(problems) == 1 and says in problems[0], err.value.problems


def test_chat_batches_carry_positions_that_restart_at_each_document(chat_and_text):
    from trainctl.config.schema import DataConfig
    from trainctl.train.loop.data import TokenBatches

    chat, _ = chat_and_text
    cfg = DataConfig(kind="memmap", datasets=[str(chat)], vocab_size=256, document_mask=True)
    data = TokenBatches(cfg, "train", 256, 4, 2, 2, 0, 1, seed=3)
    plain = TokenBatches(replace(cfg, document_mask=False), "train", 256, 4, 2, 2, 0, 1, seed=3)
    restarts = 0
    for batch, same in zip(data.micro_batches(0), plain.micro_batches(0), strict=True):
        assert torch.equal(batch[0], same[0]) and same.positions is None  # off: exactly today's batches
        assert batch.positions.shape == batch[0].shape and (batch.positions[:, 0] == 0).all()
        inside = batch[0][:, 1:][batch.positions[:, 1:] == 0]  # restarts after a row's first token
        restarts += inside.numel()
        assert (inside == ord("<")).all()  # a ChatML document starts with "<|im_start|>"
        steps = batch.positions[:, 1:] - batch.positions[:, :-1]
        assert ((steps == 1) | (batch.positions[:, 1:] == 0)).all()  # counting up between restarts
    assert restarts > 0


@pytest.mark.cli
def test_the_cli_refuses_document_mask_on_text_data_in_one_line(chat_and_text, tmp_path):
    from tests.helpers import run_cli

    _, text = chat_and_text
    proc = run_cli("plan", "recipe=tiny_cpu", "data=memmap", f"data.datasets=[{text}]", "train.seq_len=32",
                   "model.vocab_size=256", "data.document_mask=true", cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: data.document_mask=true: ") and "Traceback" not in proc.stderr


def test_the_plan_notes_the_masks_memory_and_kernel(chat_and_text):
    from trainctl.plan import build as build_plan
    from trainctl.plan.attention_kernel import predicted_kernel

    chat, _ = chat_and_text
    cfg = _composed("data=memmap", f"data.datasets=[{chat}]", "data.document_mask=true", "cluster.device=cuda",
                    "precision=bf16", "train.seq_len=4096", "model.max_seq_len=4096", "train.eval_every=0")
    notes = [n for n in build_plan(cfg).notes if n.startswith("document_mask:")]
    square = cfg.train.micro_batch * 4096**2
    assert len(notes) == 1 and f"({square / 2**30:.2f} GiB)" in notes[0]
    assert f"~{square * 2 * cfg.model.n_layers / 2**30:.2f} GiB over" in notes[0]
    assert predicted_kernel(cfg)[0] == "efficient"
    plain = _composed("data=memmap", f"data.datasets=[{chat}]", "cluster.device=cuda", "precision=bf16")
    assert not [n for n in build_plan(plain).notes if n.startswith("document_mask:")]


@pytest.mark.parity
@pytest.mark.parametrize("mode", ["full", "selective", "op"])
def test_activation_checkpointing_keeps_the_mask(mode):
    """The mask reaches the blocks by keyword: a checkpointed block recomputes with it, the same gradients."""
    from trainctl.train.parallel.activations import apply_activation_checkpointing

    _, row, positions = _packed_row()
    targets = torch.roll(row, -1, dims=1)

    def loss_and_grads(checkpointing: str | None):
        model = _model(BASE).train()
        if checkpointing:
            apply_activation_checkpointing(model, checkpointing, 2)
        loss = token_loss_sum(model, row, targets, positions=positions)
        loss.backward()
        return loss, [p.grad for p in model.parameters()]

    (got, got_grads), (want, want_grads) = loss_and_grads(mode), loss_and_grads(None)
    assert torch.equal(got, want)
    # The recomputed forward is the same, but the backward may add a gradient's terms in another order.
    for a, b in zip(got_grads, want_grads, strict=True):
        assert_close_fp(a, b, torch.float32, step_terms(BASE, row.shape[1], row.shape[1]))
