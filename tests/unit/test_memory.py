"""ZeRO arithmetic of the per-rank memory estimate, checked on Llama 2 7B by hand."""

from __future__ import annotations

import pytest

from trainctl.config.schema import ModelConfig, PrecisionConfig, ShardingConfig
from trainctl.plan import memory
from trainctl.plan.topology import ParallelDims

LLAMA2_7B = ModelConfig(
    name="llama2_7b", dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008, vocab_size=32000, max_seq_len=4096
)
# Published parameter count of Llama 2 7B; by hand: 2 x 32000 x 4096 (embedding, output) + 4096 (final norm)
# + 32 x (4 x 4096^2 + 3 x 4096 x 11008 + 2 x 4096) = 6,738,415,616.
P = 6_738_415_616
BLOCK = 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096  # one transformer block: 202,383,360
FP32 = PrecisionConfig(name="fp32", compute_dtype="fp32")
BF16 = PrecisionConfig(name="bf16", compute_dtype="bf16")


def estimate(strategy: str, precision=FP32, cpu_offload=False, **degrees) -> memory.MemoryEstimate:
    dims = ParallelDims(**degrees)
    sharding = ShardingConfig(name=strategy, strategy=strategy, cpu_offload=cpu_offload, **degrees)
    return memory.estimate(LLAMA2_7B, precision, sharding, dims)


@pytest.mark.parametrize(
    "strategy, degrees, weights, grads, optimizer",
    [
        ("none", {}, 4 * P, 4 * P, 8 * P),
        ("ddp", {"dp_replicate": 8}, 4 * P, 4 * P, 8 * P),  # replication saves nothing
        ("zero1", {"dp_replicate": 8}, 4 * P, 4 * P, P),  # 8P / 8
        ("zero2", {"dp_shard": 8}, 4 * P, P // 2, P),  # 4P / 8, 8P / 8
        ("zero3", {"dp_shard": 8}, P // 2, P // 2, P),  # 16P / 8 = 2P in all
        ("fsdp", {"dp_shard": 8}, P // 2, P // 2, P),
        ("hsdp", {"dp_replicate": 2, "dp_shard": 4}, P, P, 2 * P),  # 16P / 4: only dp_shard divides
    ],
)
def test_model_states_follow_zero_stages(strategy, degrees, weights, grads, optimizer):
    est = estimate(strategy, **degrees)
    assert (est.weights, est.grads, est.optimizer) == (weights, grads, optimizer)
    assert est.host == 0


def test_replicated_fp32_needs_no_compute_copy_and_totals_16_bytes_per_param():
    est = estimate("ddp", dp_replicate=8)
    assert est.compute_copy == 0
    assert est.total == 16 * P


def test_replicated_bf16_keeps_a_bf16_copy_of_the_whole_model():
    assert estimate("ddp", precision=BF16, dp_replicate=8).compute_copy == 2 * P


def test_sharded_params_gather_two_blocks_in_the_compute_dtype():
    # A block (202M) is larger than the embedding (131M), so it bounds one all-gather.
    assert estimate("zero3", precision=BF16, dp_shard=8).compute_copy == 2 * BLOCK * 2
    assert estimate("zero3", precision=FP32, dp_shard=8).compute_copy == 2 * BLOCK * 4


def test_zero3_bf16_total_on_8_ranks():
    assert estimate("zero3", precision=BF16, dp_shard=8).total == 2 * P + 4 * BLOCK


def test_tensor_parallel_halves_the_states_and_the_gathered_block():
    est = estimate("zero3", precision=BF16, dp_shard=4, tp=2)
    # P/2 per TP rank, 16 bytes each, sharded 4 ways: 2P.
    assert est.weights + est.grads + est.optimizer == 2 * P
    assert est.compute_copy == 2 * (BLOCK // 2) * 2


def test_pipeline_parallel_splits_like_tensor_parallel():
    est = estimate("ddp", dp_replicate=2, pp=4)
    assert est.total == 16 * P // 4


def test_cpu_offload_moves_model_states_to_host():
    est = estimate("zero3", precision=BF16, cpu_offload=True, dp_shard=8)
    assert (est.weights, est.grads, est.optimizer) == (0, 0, 0)
    assert est.host == 2 * P
    assert est.total == 4 * BLOCK


def test_to_dict_reports_bytes_and_total():
    est = estimate("zero3", precision=BF16, dp_shard=8)
    data = est.to_dict()
    assert data["total_bytes"] == est.total
    assert data["weights_bytes"] == P // 2


def test_fit_warning_when_ddp_7b_exceeds_an_h100():
    # 16 x 6.74e9 bytes = 100.4 GiB > 80 GiB.
    warning = memory.fit_warning(estimate("ddp", dp_replicate=8), "h100")
    assert warning is not None
    assert "80 GiB" in warning and "h100" in warning


def test_no_fit_warning_for_zero3_on_8_h100s_or_an_unknown_gpu():
    assert memory.fit_warning(estimate("zero3", precision=BF16, dp_shard=8), "h100") is None
    assert memory.fit_warning(estimate("ddp", dp_replicate=8), "") is None
