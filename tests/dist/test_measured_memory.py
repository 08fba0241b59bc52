"""Activation checkpointing modes and activation offload, in one process (no torchrun):
each mode computes the same loss and gradients as none, and keeps fewer activation bytes.

Two counts of the bytes a forward keeps for backward (see trainctl.train.observe.memory_stats):
- saved: distinct storages autograd's pack hook sees (saved_tensors_hooks). Inside a
  checkpointed block checkpointing's own hooks take over, so this misses what it keeps
  (the block input, the op-level cache): full and op count the same here.
- retained: storages created by the forward that are still alive before backward, whoever
  keeps them. This is the memory a device would hold, and orders op between none and full.
Measured on the 4-layer model below (selective = every 2nd block), bytes:
  retained: none 5.27M > op 3.76M > selective 3.49M > full 1.38M
  saved:    none 4.95M > selective 2.84M > full = op 0.73M
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from worker_runs import TINY

from tests.helpers import assert_close_fp, step_terms
from trainctl.config.schema import ModelConfig, PrecisionConfig, ShardingConfig, TrainConfig
from trainctl.core.dims import ParallelDims
from trainctl.models.build import build_model
from trainctl.plan import memory as plan_memory
from trainctl.plan.stages import rank_stages
from trainctl.train.loop.trainer import token_loss_sum
from trainctl.train.observe.memory_stats import retained_activation_bytes, saved_tensor_bytes
from trainctl.train.parallel.activations import activation_offload, apply_activation_checkpointing, blocks_to_checkpoint

# One process, no process group, but real forward/backward passes (~15 s): the dist tier, not unit.
pytestmark = pytest.mark.dist

MODEL = replace(TINY, n_layers=4)
MODES = ("none", "selective", "full", "op")


def tiny_model(mode: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(MODEL, "cpu")
    model.init_weights()
    apply_activation_checkpointing(model, mode, every=2)
    return model


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, MODEL.vocab_size, (4, 65), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def loss_and_grads(mode: str, offload: bool = False) -> tuple[float, list[torch.Tensor]]:
    model = tiny_model(mode)
    with activation_offload(offload, torch.device("cpu")):
        loss = loss_of(model, *batch())
    loss.backward()
    return loss.item(), [p.grad for p in model.parameters()]


@pytest.fixture(scope="module")
def reference():
    return loss_and_grads("none")


@pytest.fixture(scope="module")
def activation_bytes() -> dict[str, dict[str, int]]:
    inputs, targets = batch()
    out = {}
    for mode in MODES:
        model = tiny_model(mode)
        _, saved = saved_tensor_bytes(lambda m=model: loss_of(m, inputs, targets), exclude=model.parameters())
        loss, retained = retained_activation_bytes(lambda m=model: loss_of(m, inputs, targets))
        loss.backward()  # the counted graph must still be a working one
        out[mode] = {"saved": saved, "retained": retained}
    return out


@pytest.mark.parity
@pytest.mark.parametrize("mode,offload", [("selective", False), ("full", False), ("op", False), ("none", True), ("op", True)])
def test_mode_matches_no_checkpointing(reference, mode, offload):
    loss, grads = loss_and_grads(mode, offload)
    want_loss, want_grads = reference
    # Recomputation and offload may change the order in which a gradient's terms are added: rounding's bound.
    terms = step_terms(MODEL, 64, 4 * 64)
    assert_close_fp(torch.tensor(loss), torch.tensor(want_loss), torch.float32, terms, what="loss")
    for i, (got, want) in enumerate(zip(grads, want_grads, strict=True)):
        assert_close_fp(got, want, torch.float32, terms, what=f"gradient {i}")


def test_modes_wrap_the_blocks_they_name():
    assert blocks_to_checkpoint("none", 4, 2) == []
    assert blocks_to_checkpoint("selective", 4, 2) == [1, 3]
    assert blocks_to_checkpoint("full", 4, 2) == blocks_to_checkpoint("op", 4, 2) == [0, 1, 2, 3]
    wrapped = [type(b).__name__ for b in tiny_model("selective").layers.values()]
    assert wrapped == ["TransformerBlock", "CheckpointWrapper", "TransformerBlock", "CheckpointWrapper"]


def test_retained_bytes_order_none_selective_full(activation_bytes):
    b = {mode: v["retained"] for mode, v in activation_bytes.items()}
    assert b["none"] > b["selective"] > b["full"] > 0, b


def test_op_level_keeps_less_than_none_more_than_full(activation_bytes):
    b = {mode: v["retained"] for mode, v in activation_bytes.items()}
    assert b["full"] < b["op"] < b["none"], b
    # op keeps the matmul outputs of every block: a real share of what none keeps, not a sliver.
    per_block_op, per_block_none = (b["op"] - b["full"]) / 4, (b["none"] - b["full"]) / 4
    assert 0.3 < per_block_op / per_block_none < 0.9, (per_block_op, per_block_none)


def test_saved_tensor_hook_bytes_order(activation_bytes):
    b = {mode: v["saved"] for mode, v in activation_bytes.items()}
    assert b["none"] > b["selective"] > b["full"] > 0, b
    assert b["op"] < b["none"], b


def test_activation_offload_packs_every_saved_tensor_to_cpu():
    assert isinstance(activation_offload(False, torch.device("cpu")), contextlib.nullcontext)
    offload = activation_offload(True, torch.device("cpu"))
    assert isinstance(offload, torch.autograd.graph.save_on_cpu)
    packed = []
    pack_to_cpu = offload.pack_hook

    def recording_pack(t: torch.Tensor):
        device, host = pack_to_cpu(t)
        packed.append(host.device.type)
        return device, host

    offload.pack_hook = recording_pack  # read when the context is entered
    model = tiny_model("none")
    with offload:
        loss = loss_of(model, *batch())
    loss.backward()
    assert len(packed) > 20 and set(packed) == {"cpu"}
    assert all(p.grad is not None for p in model.parameters())


# ---- the plan's activation bytes against these counts ------------------------------------
# Several shapes (grouped-query and plain attention, small and larger vocabularies), sequence
# lengths and batch splits, every checkpointing mode, three precisions: fp32; bf16 weights as
# FSDP's mixed precision computes (the model cast to bf16: residual stream in bf16); bf16
# autocast over fp32 weights (none/ddp/zero1), where the plan adds autocast's weight copies.
# The plan (trainctl/plan/memory.py) must agree within 10% with the live storages the forward
# leaves for backward (all modes), and with the saved-tensor hooks where those see everything
# (none, selective, full: the op-level cache is kept by checkpointing itself, not saved).
SHAPES = {
    "gqa": ModelConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256, max_seq_len=256),
    "mha": ModelConfig(dim=128, n_layers=3, n_heads=8, n_kv_heads=8, ffn_dim=352, vocab_size=1000, max_seq_len=256),
    # q/k norms and a head size past dim / heads (q is 128 wide on a 64 stream)
    "qwen3": ModelConfig(family="qwen3", dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=128,
                         vocab_size=256, max_seq_len=256),
}
BATCHES = {"4x64": (4, 64), "2x160": (2, 160)}
PRECISIONS = {
    "fp32": ("none", PrecisionConfig()),
    "bf16_fsdp": ("zero3", PrecisionConfig(compute_dtype="bf16")),
    "bf16_autocast": ("none", PrecisionConfig(compute_dtype="bf16")),
}
ACT_REL = 0.10


def planned_activation_bytes(model_cfg: ModelConfig, strategy: str, precision: PrecisionConfig, mode: str, batch: int, seq: int) -> int:
    """One micro-batch's activations (head included) plus autocast's weight copies, as the plan counts them."""
    sharding = ShardingConfig(strategy=strategy)
    train = TrainConfig(seq_len=seq, micro_batch=batch, grad_accum=1, global_batch=batch, activation_checkpointing=mode, ac_every=2)
    (stage,) = rank_stages(model_cfg, sharding, 1)
    est = plan_memory.estimate(model_cfg, precision, sharding, train, ParallelDims(), stage, device="cpu")
    return est.activations_per_micro_batch + est.weight_casts


def measured_activation_bytes(model_cfg: ModelConfig, precision: str, mode: str, batch: int, seq: int) -> tuple[int, int]:
    """(saved-tensor hook bytes, live storage bytes) of one forward + loss, as the trainer computes it."""
    torch.manual_seed(0)
    model = build_model(model_cfg, "cpu")
    model.init_weights()
    apply_activation_checkpointing(model, mode, every=2)
    if precision == "bf16_fsdp":
        model.to(torch.bfloat16)  # what FSDP2's mixed precision computes with; the RoPE table stays fp32
        model.freqs.data = model.freqs.float()
    tokens = torch.randint(0, model_cfg.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16_autocast")

    def forward():
        with autocast:
            return token_loss_sum(model, inputs, targets)

    kept = [*model.parameters(), *model.buffers()]
    _, saved = saved_tensor_bytes(forward, exclude=kept)
    loss, retained = retained_activation_bytes(forward, exclude=kept)
    loss.backward()
    return saved, retained


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_plan_predicts_activation_bytes_of_every_mode(shape, batch, precision):
    model_cfg, (b, seq) = SHAPES[shape], BATCHES[batch]
    strategy, precision_cfg = PRECISIONS[precision]
    for mode in MODES:
        planned = planned_activation_bytes(model_cfg, strategy, precision_cfg, mode, b, seq)
        saved, retained = measured_activation_bytes(model_cfg, precision, mode, b, seq)
        assert retained == pytest.approx(planned, rel=ACT_REL), (mode, "live storages")
        if mode != "op":
            assert saved == pytest.approx(planned, rel=ACT_REL), (mode, "saved-tensor hooks")
