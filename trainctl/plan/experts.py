"""Expert parallelism in the plan: what each rank holds of the routed experts, and the all-to-all it pays.

Under sharding.ep the worker (train/parallel/expert.py) splits dp_shard into [efsdp, ep]: a rank holds E/ep experts
of every MoE layer, and FSDP2 shards those over the efsdp ranks. So per rank:

    stored (weights, gradients, optimizer states)   experts / (ep x efsdp) = experts / dp_shard: what FSDP2 over
                                                     dp_shard alone stores; ep does not change the states
    gathered (one MoE layer's experts, forward and   experts / ep in the compute dtype: FSDP2 gathers only this
    backward)                                        rank's experts (ep=1: all E of them)
    all-to-all (per optimizer step)                  each of the micro-batch's tokens x k routed rows leaves the rank
                                                     with probability (ep-1)/ep (even routing) and comes back: a
                                                     dispatch and a combine in forward, both again in backward
                                                     (and in the recomputed forward under full checkpointing), of
                                                     dim elements in the compute dtype, per MoE layer
Under LoRA the experts are frozen: their gradients and optimizer states are those of their adapters (model.lora
targets expert_gate_up / expert_down: one A and B per expert, core/lora.py; none otherwise), split like the experts.
Memory: besides the gathered experts, a block's exchange holds the routed rows as they arrive and their regrouped
copy (exchange_bytes_per_token), counted with the block's backward temporaries.
The all-to-all is not overlapped with compute (the experts wait for their rows): its time adds to the step, at
the bandwidth of the ep group's ranks (assess.bandwidth: NVLink within a node, the NIC across).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainctl.config.schema import ModelConfig
from trainctl.core import lora, optimizers
from trainctl.core.dims import ParallelDims
from trainctl.core.wrapping import Wrapping, fsdp_shards
from trainctl.models.registry import spec
from trainctl.plan.shapes import Tensor

FP32 = 4
# The stacked experts' tensor names in a mixture-of-experts family's spec (models/common/moe_shape.py).
EXPERT_NAME = ".experts."


def expert_params_per_layer(m: ModelConfig) -> int:
    """Routed-expert parameters of one MoE layer: E times the family spec's count of one expert (0: dense)."""
    return m.moe.num_experts * spec(m.family).expert_params(m) if m.moe.num_experts else 0


def moe_layers(m: ModelConfig, layers: int | None = None) -> int:
    """Blocks with routed experts among `layers` (default all): every block of a mixture-of-experts family."""
    return 0 if m.moe.num_experts == 0 else (m.n_layers if layers is None else layers)


def is_expert(t: Tensor) -> bool:
    return EXPERT_NAME in t.name


def ep_local(t: Tensor, ep: int) -> Tensor:
    """This rank's part of a stacked-experts tensor under expert parallelism (E/ep of its E rows); others whole."""
    return Tensor(t.name, t.rows // ep, t.cols) if ep > 1 and is_expert(t) else t


def exchange_bytes_per_token(m: ModelConfig, ep: int, compute_bytes: int) -> int:
    """The all-to-all's transient buffers per token of a micro-batch, in a block's forward and backward alike: the
    k routed rows as they arrive and their copy regrouped by expert (or their gradients); 0 without ep."""
    if ep == 1 or m.moe.num_experts == 0:
        return 0
    return 2 * m.moe.experts_per_token * m.dim * compute_bytes


@dataclass(frozen=True)
class ExpertShare:
    """One rank's routed experts (all MoE layers of its stage) and its all-to-all, per optimizer step."""

    experts_per_rank: int  # experts of each MoE layer this rank computes: E / ep
    stored_params: int  # expert parameter elements it stores (the FSDP2 shard)
    params_bytes: int  # fp32 master weights
    grads_bytes: int  # fp32 gradients (under LoRA: of the experts' adapters)
    optimizer_bytes: int  # the optimizer's states of the stored elements (under LoRA: of the adapters)
    gathered_bytes: int  # one MoE layer's experts as FSDP2 gathers them (compute dtype)
    all_to_all_bytes: float  # what this rank sends (and as much it receives), per step

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def all_to_all_bytes(m: ModelConfig, tokens: int, ep: int, layers: int, compute_bytes: int, micro_batches: int,
                     recompute: bool) -> float:
    """Bytes one rank sends per step through the token all-to-alls (`tokens` per micro-batch on the rank)."""
    if ep == 1 or layers == 0:
        return 0.0
    rows = tokens * m.moe.experts_per_token * (ep - 1) / ep
    exchanges = 4 + (2 if recompute else 0)  # dispatch + combine, forward and backward (+ the recomputed forward)
    return float(exchanges * rows * m.dim * compute_bytes * layers * micro_batches)


def expert_share(m: ModelConfig, dims: ParallelDims, wrap: Wrapping, layers: int, tokens: int, compute_bytes: int,
                 micro_batches: int, recompute: bool, optim: str = "adamw") -> ExpertShare | None:
    """The experts on one rank of a stage with `layers` blocks; None for a dense model."""
    n = moe_layers(m, layers)
    if n == 0:
        return None
    per_layer = expert_params_per_layer(m)
    shards = fsdp_shards(wrap, dims) if wrap.fsdp else 1  # ep x efsdp = dp_shard under ep
    stored = n * per_layer // shards
    learned = [Tensor("experts", stored // (m.dim * m.moe.expert_ffn_dim), m.dim * m.moe.expert_ffn_dim)]
    if lora.enabled(m.lora):  # the experts frozen: what learns is their adapters (if any), split alike
        block = spec(m.family).block_tensors(m, 0)
        learned = [Tensor(t.name, n * t.rows // shards, t.cols) for t in lora.expert_adapter_tensors(block, m.lora)]
    return ExpertShare(
        experts_per_rank=m.moe.num_experts // dims.ep,
        stored_params=stored,
        params_bytes=FP32 * stored,
        grads_bytes=FP32 * sum(t.numel for t in learned),
        optimizer_bytes=optimizers.state_bytes(optim, learned),
        gathered_bytes=compute_bytes * per_layer // dims.ep,
        # under tp each rank routes (and exchanges) only its sequence shard: tokens / tp
        all_to_all_bytes=all_to_all_bytes(m, tokens // dims.tp, dims.ep, n, compute_bytes, micro_batches, recompute),
    )
