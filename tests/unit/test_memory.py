"""The per-rank memory model, checked by hand on Llama 2 7B and on small shapes.

What the worker's tensors really hold is checked in tests/dist/test_plan_memory.py; here the
arithmetic: ZeRO stages tensor by tensor, what FSDP2 / DDP / autocast add, pipeline stages and
micro-batches in flight, activations and the phases.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.helpers import LLAMA2_7B
from trainctl.config.schema import ModelConfig, PrecisionConfig, ShardingConfig, TrainConfig
from trainctl.core.dims import ParallelDims
from trainctl.core.stages import stage_layer_counts
from trainctl.plan import activations as act
from trainctl.plan import memory, transients
from trainctl.plan.shapes import Tensor, stage_tensors, tp_local, zero1_partition
from trainctl.plan.stages import in_flight, rank_stages

# Published parameter count of Llama 2 7B; by hand: 2 x 32000 x 4096 (embedding, output) + 4096 (final norm)
# + 32 x (4 x 4096^2 + 3 x 4096 x 11008 + 2 x 4096) = 6,738,415,616.
P = 6_738_415_616
BLOCK = 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096  # one transformer block: 202,383,360
TENSORS = 32 * 9 + 3  # 9 per block, embedding, final norm, output
STEPS = 4 * TENSORS  # AdamW's float32 step counter per tensor
FP32 = PrecisionConfig(compute_dtype="fp32")
BF16 = PrecisionConfig(compute_dtype="bf16")
TRAIN = TrainConfig(seq_len=4096, micro_batch=1, grad_accum=1, global_batch=8)


def estimate(
    strategy: str, precision=FP32, train=TRAIN, cpu_offload=False, model=LLAMA2_7B, **degrees
) -> memory.RankMemory:
    dims = ParallelDims(**degrees)
    sharding = ShardingConfig(strategy=strategy, cpu_offload=cpu_offload, **degrees)
    (stage,) = rank_stages(model, sharding, train.grad_accum)[:1]
    return memory.estimate(model, precision, sharding, train, dims, stage)


@pytest.mark.parametrize(
    "strategy, degrees, weights, grads, optimizer",
    [
        ("none", {}, 4 * P, 4 * P, 8 * P + STEPS),
        ("ddp", {"dp_replicate": 8}, 4 * P, 4 * P, 8 * P + STEPS),  # replication saves nothing
        ("zero2", {"dp_shard": 8}, P // 2, P // 2, P + STEPS),  # between steps FSDP2 keeps shards only
        ("zero3", {"dp_shard": 8}, P // 2, P // 2, P + STEPS),  # 16P / 8 = 2P in all
        ("fsdp", {"dp_shard": 8}, P // 2, P // 2, P + STEPS),
        ("hsdp", {"dp_replicate": 2, "dp_shard": 4}, P, P, 2 * P + STEPS),  # 16P / 4: only dp_shard divides
    ],
)
def test_model_states_follow_zero_stages(strategy, degrees, weights, grads, optimizer):
    est = estimate(strategy, **degrees)
    assert (est.params, est.grads, est.optimizer) == (weights, grads, optimizer)
    assert est.host == 0


def test_zero1_gives_whole_tensors_largest_first_to_the_emptiest_rank():
    tensors = [
        Tensor("layers.0.attention.wq.weight", 10, 10),
        Tensor("layers.0.feed_forward.w1.weight", 6, 10),
        Tensor("layers.0.feed_forward.w2.weight", 5, 10),
        Tensor("norm.weight", 7, 1),
    ]
    # decayed group (matmuls): 100 -> rank 0, 60 -> rank 1, 50 -> rank 1 (110); then the norm (7) -> rank 0 (107).
    assert zero1_partition(tensors, 2) == [(107, 2), (110, 2)]


def test_zero1_busiest_rank_holds_more_than_an_even_share():
    est = estimate("zero1", dp_replicate=8)
    assert (est.params, est.grads) == (4 * P, 4 * P)
    assert 8 * P // 8 < est.optimizer < 8 * P // 8 + 8 * 32000 * 4096  # at most one largest tensor more


def test_ddp_keeps_flat_gradient_buckets_beside_the_gradients():
    assert estimate("ddp", dp_replicate=8).ddp_buckets == 4 * P
    assert estimate("none").ddp_buckets == 0
    assert estimate("zero3", dp_shard=8).ddp_buckets == 0


def test_autocast_keeps_a_bf16_copy_of_every_matmul_weight():
    # All but the embedding lookup, the norms and the output projection (the chunked loss keeps its weight's
    # gradient instead, counted with the head's activations).
    matmul = P - 2 * 32000 * 4096 - (2 * 32 + 1) * 4096
    assert estimate("ddp", precision=BF16, dp_replicate=8).weight_casts == 2 * matmul
    assert estimate("ddp", precision=FP32, dp_replicate=8).weight_casts == 0
    assert estimate("zero3", precision=BF16, dp_shard=8).weight_casts == 0  # FSDP casts per unit instead
    full = dataclasses.replace(TRAIN, activation_checkpointing="full")
    assert estimate("ddp", precision=BF16, train=full, dp_replicate=8).weight_casts == 0
    # Under tensor parallelism the loss is dense: the output weight's copy is kept (its tp shard).
    tp_full = estimate("ddp", precision=BF16, train=full, dp_replicate=4, tp=2)
    assert tp_full.weight_casts == 2 * 32000 * 4096 // 2


def test_zero3_gathers_head_at_the_loss_and_two_blocks_in_backward():
    est = estimate("zero3", precision=BF16, dp_shard=8)
    assert est.gathered_loss == 2 * (32000 * 4096 + 4096)  # norm + output stay gathered until their backward
    assert est.gathered_block == BLOCK * (
        3 * 2 + 4
    )  # gathered + prefetched (bf16), unsharded grad (bf16), reduce input (fp32)


def test_zero2_keeps_the_whole_model_gathered_until_backward():
    assert estimate("zero2", precision=BF16, dp_shard=8).gathered_loss == 2 * P


def test_fsdp_accumulation_keeps_unsharded_fp32_gradients():
    accum = dataclasses.replace(TRAIN, grad_accum=4, global_batch=32)
    assert estimate("zero3", precision=BF16, train=accum, dp_shard=8).unsharded_grads == 4 * P
    assert estimate("zero3", precision=BF16, dp_shard=8).unsharded_grads == 0
    assert estimate("ddp", precision=BF16, train=accum, dp_replicate=8).accumulated_grads == 4 * P


def test_cpu_offload_moves_model_states_to_host():
    est = estimate("zero3", precision=BF16, cpu_offload=True, dp_shard=8)
    assert (est.params, est.grads, est.optimizer) == (0, 0, 0)
    assert est.host == 2 * P + STEPS
    assert est.gathered_block > 0  # the device still gathers units


def test_activation_offload_moves_saved_activations_to_host():
    offload = dataclasses.replace(TRAIN, activation_offload=True)
    kept, moved = (
        estimate("zero3", precision=BF16, dp_shard=8),
        estimate("zero3", precision=BF16, train=offload, dp_shard=8),
    )
    assert moved.activations == 0
    assert moved.host == kept.activations


def test_tensor_parallel_replicates_norms_and_splits_the_rest():
    local = [tp_local(t, 4) for t in stage_tensors(LLAMA2_7B, range(32), True, True)]
    norms = (2 * 32 + 1) * 4096
    assert sum(t.numel for t in local) == (P - norms) // 4 + norms
    wo = next(t for t in local if t.name == "layers.0.attention.wo.weight")
    assert (wo.rows, wo.cols) == (4096, 1024)  # row-parallel: split on its input dim


def test_pipeline_stages_split_layers_and_hold_the_ends():
    assert stage_layer_counts(10, 4, []) == [3, 3, 2, 2]
    sharding = ShardingConfig(strategy="ddp", pp=4)
    ranks = rank_stages(LLAMA2_7B, sharding, grad_accum=8)
    assert [len(r.layers) for r in ranks] == [8, 8, 8, 8]
    assert (ranks[0].first, ranks[0].last, ranks[3].first, ranks[3].last) == (True, False, False, True)
    interleaved = rank_stages(
        LLAMA2_7B, ShardingConfig(strategy="ddp", pp=4, pp_schedule="interleaved_1f1b", pp_stages_per_rank=2), 8
    )
    assert interleaved[0].layers == (*range(0, 4), *range(16, 20))  # stages 0 and 4 on pp rank 0


@pytest.mark.parametrize(
    "schedule, rank, v, expected",
    [
        ("gpipe", 0, 1, 8),  # every forward before any backward
        ("1f1b", 0, 1, 4),  # pp - rank warm-up forwards
        ("1f1b", 3, 1, 1),
        ("interleaved_1f1b", 0, 2, (4 + 2 * 3 + 1) / 2),  # warm-up (v-1) x 4 + 2 (pp-1-r), +1, in chunks of 1/v
        ("interleaved_zero_bubble", 0, 2, (4 + 3 + 1) / 2),
    ],
)
def test_micro_batches_in_flight_per_schedule(schedule, rank, v, expected):
    assert in_flight(schedule, rank, pp=4, v=v, n=8) == expected


def test_block_activations_by_hand_and_checkpointing_order():
    m = ModelConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256)
    fp32 = act.ActLayout(compute_bytes=4, residual_bytes=4)
    # 16d + 8 + 4ad + 2a kv + 4H + 4af with d=64, a=4, kv=32, H=4, f=128
    assert act.block_none(m, fp32) == 16 * 64 + 8 + 16 * 64 + 8 * 32 + 16 + 16 * 128
    assert act.block_full(m, fp32) == 4 * 64
    assert act.block_none(m, fp32) > act.block_op(m, fp32) > act.block_full(m, fp32)
    tp2 = act.ActLayout(compute_bytes=4, residual_bytes=4, tp=2)
    assert act.block_none(m, tp2) > act.block_none(m, fp32) / 2  # the gathered matmul inputs are not divided


def test_dense_loss_buffers_are_two_fp32_vocab_gradients_per_token():
    est = estimate("zero3", precision=BF16, dp_shard=4, tp=2)  # tp: the dense loss
    assert est.loss_buffers == 2 * 4 * 32000 * 4096


def test_fsdp_reduce_scatters_the_heads_gradient_in_the_loss_phase():
    short = dataclasses.replace(TRAIN, seq_len=256)  # few tokens: the head's gradient outweighs the logits'
    head = 32000 * 4096 // 2  # the output weight's tp shard
    # The head's unsharded bf16 gradient and FSDP2's fp32 reduce-scatter input of its unit (with the final norm).
    assert estimate("zero3", precision=BF16, train=short, dp_shard=4, tp=2).loss_buffers == 2 * head + 4 * (head + 4096)
    tied = dataclasses.replace(LLAMA2_7B, tie_embeddings=True)  # the head is in the root unit: reduced at the end
    assert transients.head_reduce_bytes(tied, rank_stages(tied, ShardingConfig(strategy="zero3", dp_shard=8), 1)[0],
                                    ParallelDims(dp_shard=8), memory.wrapping("zero3", ParallelDims(dp_shard=8), BF16),
                                    4) == 0


def test_chunked_loss_buffers_hold_no_whole_fp32_logits():
    chunked = estimate("zero3", precision=BF16, dp_shard=8)
    # The largest of: the fp32 weight-gradient accumulator + one chunk (bf16 logits, fp32, bf16 gradient); the
    # accumulator and its bf16 cast at the end of forward; backward scales in place and adds nothing (no autocast).
    # The step's other phases leave room for all 4096 tokens of the micro-batch under the peak: one chunk.
    chunk = chunked.tokens_per_micro_batch
    assert chunked.loss_chunk == chunk == 4096
    assert chunked.peak_phase != "loss"
    forward = 4 * 32000 * 4096 + chunk * 32000 * (4 + 2 + 2)
    cast = (4 + 2) * 32000 * 4096
    assert chunked.loss_buffers == max(forward, cast)
    # Llama 3's 128k vocabulary at 8 x 2048 tokens: what the head keeps plus the loss's transients.
    llama3 = ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256)
    tokens = 8 * 2048

    def around_loss(chunked_loss: bool) -> float:
        lay = act.ActLayout(compute_bytes=2, residual_bytes=2, chunked_loss=chunked_loss)
        kept = act.head_bytes(llama3, lay) * tokens + act.head_fixed_bytes(llama3, lay)
        return kept + act.loss_transient_bytes(llama3, lay, tokens)

    fp32_logits = 4 * 128256 * tokens  # 8.4 GB
    assert around_loss(False) - around_loss(True) > 2 * fp32_logits


def test_peak_is_the_largest_phase_and_to_dict_reports_it():
    est = estimate("zero3", precision=BF16, dp_shard=8)
    phases = est.phases()
    assert est.peak == max(phases.values()) and est.peak_phase in phases
    data = est.to_dict()
    assert data["peak_bytes"] == est.peak and data["params_bytes"] == P // 2
    assert data["states_bytes"] == est.params + est.grads + est.optimizer


def test_cuda_rms_norm_keeps_its_input_and_rstd_only():
    """The fused CUDA kernel saves the fp32 input and rstd; the CPU path also keeps x * rstd (4 dim bytes more)."""
    from dataclasses import replace as dc_replace

    m = ModelConfig(name="t", dim=256, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=704, vocab_size=256)
    cpu = act.ActLayout(compute_bytes=2, residual_bytes=4)
    cuda = dc_replace(cpu, fused_norm=True)
    assert act.block_none(m, cpu) - act.block_none(m, cuda) == 2 * 4 * m.dim  # two norms per block


def test_a_compiled_block_keeps_matmul_inputs_and_outputs_not_the_norms_fp32_work():
    from dataclasses import replace as dc_replace

    m = ModelConfig(name="t", dim=256, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=704, vocab_size=256)
    lay = act.ActLayout(compute_bytes=4, residual_bytes=4)
    compiled = dc_replace(lay, compiled=True)
    # the CPU measurement (tests/dist/test_plan_memory.py): 15656 bytes per token against eager's 20520
    assert act.block_compiled(m, lay) == 15656 and act.block_none(m, lay) == 20520
    assert act.blocks_bytes(m, compiled, "none", 2, 2) == 2 * 15656
    assert act.blocks_bytes(m, compiled, "full", 2, 2) == act.blocks_bytes(m, lay, "full", 2, 2)
