"""Throughput: FLOPs per token, step time at an assumed MFU, time to the configured tokens, GPU-hours.

FLOPs per token (flops.py): 6N over the matmul weights plus attention's 12 L d s, counted over
the full sequence as in PaLM's MFU definition; causal kernels skip the masked half, so the
FLOPs the device actually executes for attention are 6 L d s (`attention_flops_causal`). MFU
(the worker's and the plan's) uses the full count, so figures compare with published ones.

The time model, stated once (every term is per optimizer step, on the busiest rank):
    compute   (model FLOPs + recomputed FLOPs) / (dp x cp x tp x pp ranks x peak x MFU); the
              assumed MFU (cluster.assumed_mfu, default 0.4: a typical tuned bf16 FSDP run on
              H100s; the project has no measured figure under benchmarks/ yet) covers kernel
              efficiency and the communication that overlaps with compute
    small     the assumed MFU holds for micro-batches of at least 8192 tokens per rank; each halving
              below that costs 5% (smaller matmuls, fixed per-micro-batch overheads)
    compile   train.compile runs COMPILE_SPEEDUP times faster than eager (measured; see the constants)
    recompute full checkpointing re-runs each wrapped block's forward: +2 x its matmul FLOPs
              + attention's forward per token (about a third of the blocks' work), at RECOMPUTE_SPEEDUP
              times the step's rate (measured); op re-runs
              only pointwise ops: no FLOPs, counted as +3% of the compute time (memory-bound)
    bubble    pipeline idle time: compute x (pp - 1) / (v x m) for gpipe/1f1b (v = 1) and
              interleaved 1f1b (m micro-batches, v stages per rank); a third of that for zero-bubble
    tp        sequence-parallel all-gathers and reduce-scatters (4 per block forward, 4 backward, of
              tokens x dim in the compute dtype, x (tp-1)/tp) at the node's bus bandwidth, not hidden
    cp        ring attention (torch's context_parallel, all-gather rotation: not overlapped): each block's
              forward gathers the other cp - 1 ranks' k and v (tokens x kv width each, kv repeated to
              n_heads for the ring kernels), its backward gathers them again and returns their
              gradients: 3 x 2 x tokens x kv x (cp - 1) elements in the compute dtype per block and
              micro-batch, at the cp group's bandwidth; the compute term already splits the tokens over cp
    fsdp      zero3 gathers every unit twice per micro-batch (forward, backward), zero2 once; the
              gradients are reduce-scattered once per step; hidden behind compute up to its length; the
              cp ranks join the group (the worker's dp_shard_cp or dp_cp mesh: same weights, other tokens)
    fp8       float8 matmuls run the converted Linears' share of the FLOPs (6 x their weights per token, over
              the model FLOPs) FP8_GEMM_EFFICIENCY[recipe] x (fp8 peak / bf16 peak) times faster; attention, the
              excluded layers (the output head by default) and everything else stay at the bf16 rate
              (Amdahl); the casts and amax reductions are inside the assumed MFU
    ep        expert parallelism's token all-to-alls (plan/experts.py): each routed row that leaves the rank
              goes and comes back in forward and backward, at the ep group's bandwidth, not hidden
    offload   cpu_offload: the parameter shard crosses PCIe (25 GB/s) at every gather, gradients once,
              and AdamW runs on the host at 1 G parameters/s per node, shared by its ranks
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainctl.config.schema import ModelConfig
from trainctl.core.wrapping import Wrapping
from trainctl.plan.flops import flops_per_token, fp8_matmul_params, layer_params

DEFAULT_MFU = 0.4
FULL_SPEED_TOKENS = 8192
HALVING_COST = 0.05
OP_RECOMPUTE_OVERHEAD = 0.03
PCIE_BYTES_PER_S = 25e9
# Calibrated on NVIDIA H200 (torch 2.11.0+cu130, torchao 0.18.0, Llama 3.2 1B shape, 8 x 2048 tokens: the
# variants in benchmarks/h200/2026-11-27/variants-*.json; tests/unit/test_plan_calibration.py checks the plan
# against them). One shape only: how these terms move with the model's width is for the next GPU run to measure.
# The part of the fp8/bf16 peak ratio float8 training reaches per recipe, casts and amax reductions included:
# tensorwise measured 1.133x and rowwise 0.981x the compiled bf16 run with 71% of the FLOPs in float8 matmuls.
# rowwise_with_gw_hp runs its weight-gradient GEMMs (a third of the matmul FLOPs) in bf16 (fp8_share).
FP8_GEMM_EFFICIENCY = {"tensorwise": 0.599, "rowwise": 0.487, "rowwise_with_gw_hp": 0.487}
# torch.compile (Inductor's fused pointwise and norm kernels) over eager: 62,909 / 52,517 tokens/s measured.
COMPILE_SPEEDUP = 1.198
# Recomputed forward work runs faster than the step's average FLOP (no optimizer, loss head or launch overheads
# repeat): full AC measured 0.854x and selective 0.920x the compiled no-AC speed, where the FLOPs alone give
# 0.788x and 0.881x; both fit recomputation at 1.56x the step's rate.
RECOMPUTE_SPEEDUP = 1.56
HOST_ADAMW_PARAMS_PER_S = 1e9  # per node (DeepSpeed's CPU Adam class of speed on a many-core host)


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    recompute_s: float
    bubble_s: float
    tp_comm_s: float
    exposed_dp_comm_s: float
    offload_s: float
    cp_comm_s: float = 0.0
    ep_comm_s: float = 0.0  # expert parallelism's token all-to-alls (plan/experts.py), not overlapped

    @property
    def total_s(self) -> float:
        return (self.compute_s + self.recompute_s + self.bubble_s + self.tp_comm_s + self.exposed_dp_comm_s
                + self.offload_s + self.cp_comm_s + self.ep_comm_s)

    def to_dict(self) -> dict:
        return {**self.__dict__, "total_s": self.total_s}


def micro_batch_efficiency(tokens: int) -> float:
    """Share of the assumed MFU reached with `tokens` per micro-batch on a rank (module doc)."""
    if tokens >= FULL_SPEED_TOKENS:
        return 1.0
    return (1 - HALVING_COST) ** math.log2(FULL_SPEED_TOKENS / max(1, tokens))


def attention_flops_causal(m: ModelConfig, seq_len: int) -> float:
    """Attention FLOPs per token that causal kernels execute (half of the full-sequence count)."""
    return 6.0 * m.n_layers * m.dim * seq_len


def recompute_flops_per_token(m: ModelConfig, seq_len: int, mode: str, wrapped: int) -> float:
    """Extra FLOPs per token that checkpointing re-runs in backward (forward of the wrapped blocks)."""
    if mode in ("none", "op"):
        return 0.0
    block_forward = 2.0 * (layer_params(m) - 2 * m.dim) + 4.0 * m.dim * seq_len
    return wrapped * block_forward


def bubble_fraction(schedule: str, pp: int, micro_batches: int, stages_per_rank: int) -> float:
    """Idle share of a pipeline step relative to its compute (module doc)."""
    if pp == 1:
        return 0.0
    ideal = (pp - 1) / (stages_per_rank * micro_batches)
    return ideal / 3 if schedule == "interleaved_zero_bubble" else ideal


def tp_comm_bytes(m: ModelConfig, tokens: int, blocks: int, tp: int, compute_bytes: int) -> float:
    """Bytes one rank moves per micro-batch for sequence-parallel TP (8 collectives per block)."""
    if tp == 1:
        return 0.0
    return 8.0 * blocks * tokens * m.dim * compute_bytes * (tp - 1) / tp


def cp_comm_bytes(tokens: int, kv: int, blocks: int, cp: int, compute_bytes: int) -> float:
    """Bytes one rank receives per micro-batch for ring attention over `cp` ranks (`tokens`: this rank's share;
    `kv`: the k and v width the ring moves)."""
    if cp == 1:
        return 0.0
    return 3.0 * 2 * blocks * tokens * kv * compute_bytes * (cp - 1)


def gathers_per_micro_batch(wrap: Wrapping) -> int:
    """FSDP2 gathers a unit for forward and, when resharded after it, again for backward."""
    return 2 if wrap.reshard_after_forward else 1


def fsdp_comm_bytes(
    wrap: Wrapping, local_params: int, compute_bytes: int, reduce_bytes: int, shards: int, micro_batches: int
) -> float:
    """Bytes one rank moves per step for FSDP2's gathers and reduce-scatters (0 without parameter sharding)."""
    if shards == 1 or not wrap.fsdp:
        return 0.0
    gathers = gathers_per_micro_batch(wrap) * micro_batches
    share = (shards - 1) / shards
    return local_params * share * (gathers * compute_bytes + reduce_bytes)


def ddp_comm_bytes(wrap: Wrapping, local_params: int, replicas: int) -> float:
    """Bytes one rank moves per step for DDP's fp32 ring all-reduce (and zero1's parameter broadcast)."""
    if replicas == 1 or not wrap.all_reduces_over_replicas:
        return 0.0
    share = (replicas - 1) / replicas
    broadcast = 4.0 * local_params * share if wrap.zero1 else 0.0
    return 2 * 4.0 * local_params * share + broadcast


def offload_seconds(stored_params: int, wrap: Wrapping, micro_batches: int, ranks_per_node: int) -> float:
    """PCIe copies and the host AdamW step of cpu_offload, per step (not overlapped: an upper bound)."""
    gathers = gathers_per_micro_batch(wrap) * micro_batches
    copies = 4.0 * stored_params * (gathers + 1)
    return copies / PCIE_BYTES_PER_S + stored_params * ranks_per_node / HOST_ADAMW_PARAMS_PER_S


def hours(seconds: float | None) -> float | None:
    return None if seconds is None else seconds / 3600


def fp8_share(m: ModelConfig, seq_len: int, exclude: list[str] | tuple[str, ...], recipe: str = "tensorwise",
              fp8_filter: str = "all") -> float:
    """The share of the model FLOPs per token that float8 matmuls run (rowwise_with_gw_hp: 2 of their 3 GEMMs)."""
    gemms = 2 / 3 if recipe == "rowwise_with_gw_hp" else 1.0
    return gemms * 6.0 * fp8_matmul_params(m, exclude, fp8_filter, recipe) / flops_per_token(m, seq_len)


def fp8_time_factor(m: ModelConfig, seq_len: int, exclude: list[str] | tuple[str, ...],
                    peak_ratio: float | None, recipe: str = "tensorwise", fp8_filter: str = "all") -> float:
    """Compute time with float8 over the same run's bf16 time (module doc: fp8); 1.0 when the device's fp8 peak
    is unknown."""
    if not peak_ratio:
        return 1.0
    share = fp8_share(m, seq_len, exclude, recipe, fp8_filter)
    efficiency = FP8_GEMM_EFFICIENCY.get(recipe, FP8_GEMM_EFFICIENCY["tensorwise"])
    return (1.0 - share) + share / (efficiency * peak_ratio)
