"""Per-rank device memory at its peak, broken down, following what the worker does.

Model states are counted tensor by tensor (trainctl/plan/shapes.py), so the predicted parameter,
gradient and optimizer bytes are those of the live tensors on each rank (tests/dist checks it). This module
sums the phases of a step; plan/rank_states.py counts the model states, plan/transients.py the rest:

    strategy          weights (fp32)      grads (fp32, after backward)   optimizer (core/optimizers.py)
    none, ddp         local               local                          local
    zero1             local               local                          ZeroRedundancyOptimizer's
                                                                         whole-tensor partition
    zero2, zero3,     FSDP2 shard of      FSDP2 shard                    FSDP2 shard
    hsdp              dp_shard x cp (rank 0's chunk, the largest; the cp ranks join the shard group)
("local": the tensor-parallel share of this pipeline rank's stage.) Master weights, gradients
and optimizer states are fp32 whatever the compute dtype. Which wrapper a strategy gets is
core.wrapping's decision, the one the worker's parallelize applies: this module branches on it.

On top of them, what the worker's libraries hold during a step, where they differ from the
textbook ZeRO table (the worker wins):
- DDP (ddp, zero1 without tp/pp) keeps flat gradient buckets beside .grad
  (gradient_as_bucket_view=False): one more fp32 copy of the gradients, all the time.
- torch.autocast (none/ddp/zero1 under bf16/fp16) keeps its compute-dtype copy of each matmul
  weight from forward to backward (saved for backward); checkpointed blocks re-cast instead.
- FSDP2 gathers units (embedding, each block, norm + output, root) in the compute dtype. zero3
  reshards blocks after forward; norm + output (and a tied embedding, in the root) stay gathered
  until their backward. zero2 keeps every unit gathered from forward to backward.
- FSDP2 with grad_accum > 1 skips the reduce-scatter on all but the last micro-batch and keeps
  the unsharded gradients in between (in the fp32 reduce dtype): a full fp32 gradient copy.
- Backward of one FSDP2 unit: its gathered weights, the prefetched next unit, its unsharded
  gradient (compute dtype) and the reduce-scatter input (reduce dtype).
- Loss: chunked over tokens (core/loss_head.py) it keeps the input's and the output weight's
  gradients, computed in forward; where it is dense (tp, pp, a float8 output layer) log_softmax's
  fp32 [tokens, V] output is saved and backward adds two more fp32 [tokens, V] gradients
  (trainctl/plan/activations.py).
- Expert parallelism (plan/experts.py): a block's routed experts are gathered E/ep at a time, and its token
  exchange's buffers (the rows as they arrive and regrouped, or their gradients) join the block's temporaries.
- cpu_offload moves weights, gradients and optimizer states to host memory; the device keeps
  the gathered units and their gradients.
- The optimizer step: its temporaries are the optimizer's (core/optimizers.py): fused AdamW on CUDA
  allocates nothing; the foreach AdamW used elsewhere (CPU, or CUDA parameters under cpu_offload
  run on the host) allocates one fp32 temporary per element of its largest param group; Muon's Newton-Schulz
  works on the whole largest matrix, gathered from its shards under FSDP2 or tp. Under zero1 the ranks step
  different tensors: the step's temporaries are the largest any data-parallel rank's are (Adafactor's follow the
  tensors' order, not their state bytes), beside the busiest rank's states.
Phases: the peak is the largest of (loss) the start of backward, (block) the first block's
backward, (end) the end of backward, and (step) the optimizer step; each phase lists what is
alive then. Gradients are conservatively counted as fully present from the end of backward on,
and at the loss only when grad_accum > 1 (earlier micro-batches' gradients are there).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from trainctl.config.schema import ModelConfig, PrecisionConfig, ShardingConfig, TrainConfig
from trainctl.core import lora, objectives, optimizers
from trainctl.core.dims import ParallelDims
from trainctl.core.float8 import converts
from trainctl.core.lora import quantized_base
from trainctl.core.loss_head import chunked_loss, planned_chunk_tokens
from trainctl.core.tensors import Tensor
from trainctl.core.wrapping import Wrapping, fsdp_shards, wrapping
from trainctl.plan import activations as act
from trainctl.plan.experts import exchange_bytes_per_token
from trainctl.plan.rank_states import (
    busiest_dp_rank,
    local_tensors,
    param_bytes,
    stepped_tensors,
    stored_elements,
    stored_of,
    trainable,
    trainable_of,
)
from trainctl.plan.shapes import stage_tensors
from trainctl.plan.stages import RankStages
from trainctl.plan.transients import (
    DTYPE_BYTES,
    activation_bytes,
    activation_layout,
    end_parts,
    gathered_bytes,
    head_reduce_bytes,
    offloaded,
    weight_cast_bytes,
)

FP32 = 4
GIB = 2**30


@dataclass(frozen=True)
class RankMemory:
    """Bytes on one rank (the busiest of its pipeline stage): states, transients, and the phases' sums."""

    pp_rank: int
    params: int  # fp32 master weights stored on this rank
    grads: int  # fp32 gradients stored after backward
    optimizer: int  # optimizer states (and step scalars) of the tensors this rank steps (core/optimizers.py)
    ddp_buckets: int
    host: int  # in host memory (cpu_offload); not part of any phase
    gathered_loss: int  # FSDP units gathered at the start of backward (compute dtype)
    gathered_block: int  # FSDP during one block's backward: two gathered blocks, unsharded grad, reduce input
    gathered_end: int  # FSDP at the end of backward: the largest unit's gather, gradient and reduce input
    unsharded_grads: int  # FSDP no-sync accumulation between micro-batches (grad_accum > 1)
    accumulated_grads: int  # replicated .grad kept between micro-batches (grad_accum > 1)
    weight_casts: int  # autocast copies of matmul weights, saved for backward
    activations: int  # saved for backward, every micro-batch in flight
    activations_per_micro_batch: int
    loss_buffers: int  # around the loss: chunked temporaries or the dense loss gradients; FSDP2: the head RS input
    recompute: int  # one checkpointed block re-run in backward
    grad_temp: int  # activation gradients alive inside one block's backward (SwiGLU's, the largest)
    head_activations: int  # the head's saved tensors (freed before the blocks' backward)
    last_block_activations: int  # what is still saved when the first block's backward runs
    grads_head: int  # gradients stored once the head's backward ran
    grads_tail: int  # gradients stored once every block but the first (and the embedding) ran backward
    step_temp: int  # the optimizer step's temporaries
    tokens_per_micro_batch: int  # on this rank: micro_batch x seq_len / cp
    in_flight: float
    local_params: int  # elements of this rank's tensor-parallel share of its stage, before data-parallel sharding
    loss_chunk: int = 0  # tokens per chunk of the chunked loss head (0: the dense loss or no head on this rank)
    reference: int = 0  # DPO without LoRA: the frozen reference's fp32 weights on this rank (core/objectives.py)

    @property
    def states(self) -> int:
        """Weights + gradients + optimizer states on the device."""
        return self.params + self.grads + self.optimizer

    def phases(self) -> dict[str, int]:
        """Bytes alive at each candidate peak (module doc).

        Inside backward, activations are freed block by block while gradients appear, so the
        blocks' backward peaks at one of its ends: the last block (all activations but the
        head's, the head's gradients) or the first block (the gradients of all later blocks).
        """
        base = self.params + self.optimizer + self.ddp_buckets + self.reference
        early = self.unsharded_grads + self.accumulated_grads + self.weight_casts
        block = self.gathered_block + self.recompute + self.grad_temp
        return {
            "loss": base + early + self.activations + self.gathered_loss + self.loss_buffers,
            "last_block": base + early + self.activations - self.head_activations + self.grads_head + block,
            "first_block": base + max(self.grads_tail, self.accumulated_grads) + self.last_block_activations + block,
            "end": base + self.grads + self.gathered_end,
            "step": base + self.grads + self.step_temp,
        }

    @property
    def peak(self) -> int:
        """Bytes the allocator holds at the step's peak (what torch.cuda.max_memory_allocated measures)."""
        return max(self.phases().values())

    @property
    def peak_phase(self) -> str:
        phases = self.phases()
        return max(phases, key=phases.get)

    def to_dict(self) -> dict:
        counts = ("pp_rank", "tokens_per_micro_batch", "in_flight", "local_params", "loss_chunk")
        data = {k: v for k, v in asdict(self).items() if k not in counts}
        out = {f"{k}_bytes": v for k, v in data.items()}
        out["states_bytes"] = self.states
        out["phases_bytes"] = self.phases()
        out["peak_bytes"] = self.peak
        out["peak_phase"] = self.peak_phase
        out.update(pp_rank=self.pp_rank, tokens_per_micro_batch=self.tokens_per_micro_batch, in_flight=self.in_flight,
                   local_params=self.local_params, loss_chunk=self.loss_chunk)
        return out


def step_temp_bytes(optim, learn: list[Tensor], stepped: list[Tensor], whole: list[Tensor], wrap: Wrapping,
                    dims: ParallelDims, fused: bool) -> int:
    """The optimizer step's temporaries on the busiest rank: under zero1 the largest of any data-parallel rank's
    share (its partition, largest first), which need not be the rank with the most state bytes."""
    shares = [stepped_tensors(learn, wrap, dims, r) for r in range(dims.dp_replicate)] if wrap.zero1 else [stepped]
    shards = fsdp_shards(wrap, dims) if wrap.fsdp else 1
    return max(optimizers.step_temp_bytes(optim, mine, whole, fused, shards) for mine in shares)


def estimate(m: ModelConfig, precision: PrecisionConfig, sharding: ShardingConfig, train: TrainConfig,
             dims: ParallelDims, stage: RankStages, device: str = "cuda", optim="adamw") -> RankMemory:
    """Per-rank memory of one pipeline rank's stage (module doc), for a resolved layout and optimizer (optim.name, or
    the optim config: core/optimizers.py)."""
    wrap = wrapping(sharding.strategy, dims, precision)
    c, r = DTYPE_BYTES[precision.compute_dtype], DTYPE_BYTES[precision.reduce_dtype]
    tensors = local_tensors(m, stage, dims.tp)
    local = sum(t.numel for t in tensors)
    learn = trainable(tensors)  # with LoRA only the adapters have gradients, DDP buckets and optimizer states
    learn_local = sum(t.numel for t in learn)
    busiest = busiest_dp_rank(tensors, wrap, dims, optim)
    stored = stored_elements(tensors, wrap, dims, busiest)[0]
    stepped = stepped_tensors(learn, wrap, dims, busiest_dp_rank(learn, wrap, dims, optim))
    fsdp = wrap.fully_shard
    params, grads = param_bytes(m, tensors, stored, wrap, dims, busiest), FP32 * stored_of(learn, wrap, dims)
    optimizer = optimizers.state_bytes(optim, stepped)
    # Preference objectives: a pair is two sequences, their loss reads whole logits (no chunked head), and DPO
    # without LoRA holds a frozen fp32 reference sharded as the weights (core/objectives.py); the reference's
    # no-grad forward runs before the policy's and frees its logits first, so it adds no transient at the peak.
    cost = objectives.cost(train.objective, lora.enabled(m.lora))
    tokens = train.micro_batch * cost.sequences_per_sample * train.seq_len // dims.cp
    chunked = chunked_loss(m, precision, dims.tp, dims.pp) and not objectives.is_preference(train.objective)
    lay = activation_layout(precision, wrap, dims, chunked, train.compile, device)
    reference = FP32 * stored if cost.reference_weights else 0
    saved = activation_bytes(m, train, lay, stage, tokens)
    if train.activation_offload:
        saved = offloaded(saved, m, lay, train, stage, tokens)
    mode = train.activation_checkpointing
    wrapped = act.checkpointed_blocks(mode, len(stage.layers), train.ac_every)
    # QLoRA's NF4 weights: torchao's linear saves the 4-bit weight and dequantizes again in backward, no copy kept.
    cast = [t for t in autocast_cast(tensors, precision) if not quantized_base(t.name, m.lora)]
    casts = weight_cast_bytes(cast, stage, c, wrapped, lay.chunked_loss) if lay.autocast else 0
    first_part, head_part = end_parts(tensors, stage)
    at_loss, during_block, at_end = gathered_bytes(m, stage, dims, wrap, c, r, precision)
    accumulating = train.grad_accum > 1
    unsharded = max(c, r) * learn_local if fsdp and accumulating else 0
    head_reduce = head_reduce_bytes(m, stage, dims, wrap, r)
    whole = trainable(stage_tensors(m, stage.layers, stage.first, stage.last))  # Muon's Newton-Schulz gathers them
    step_temp = step_temp_bytes(optim, learn, stepped, whole, wrap, dims, device == "cuda" and not sharding.cpu_offload)
    host = saved.host
    if sharding.cpu_offload:
        host, params, grads, optimizer, step_temp = host + params + grads + optimizer + reference, 0, 0, 0, 0
        reference = 0
    mem = RankMemory(
        pp_rank=stage.pp_rank,
        params=params,
        grads=grads,
        optimizer=optimizer,
        ddp_buckets=FP32 * learn_local if wrap.ddp else 0,
        reference=reference,
        host=host,
        gathered_loss=at_loss,
        gathered_block=during_block,
        gathered_end=at_end,
        unsharded_grads=unsharded,
        accumulated_grads=grads if accumulating and not fsdp else 0,
        weight_casts=casts,
        activations=saved.everything,
        activations_per_micro_batch=saved.one,
        loss_buffers=act.loss_transient_bytes(m, lay, tokens, head_reduce, 0) if stage.last else 0,
        recompute=(int(act.recompute_bytes(m, lay, mode) * tokens) if wrapped else 0) + saved.unpacked,
        grad_temp=int((act.block_grad_bytes(m, lay) + exchange_bytes_per_token(m, dims.ep, c)) * tokens)
        if stage.layers else 0,
        head_activations=saved.head,
        last_block_activations=saved.first_block,
        grads_head=0 if sharding.cpu_offload else FP32 * stored_of(trainable_of(head_part, learn), wrap, dims),
        grads_tail=0 if sharding.cpu_offload else grads - FP32 * stored_of(trainable_of(first_part, learn), wrap, dims),
        step_temp=step_temp,
        tokens_per_micro_batch=tokens,
        in_flight=stage.in_flight,
        local_params=local,
    )
    if not (stage.last and lay.chunked_loss):
        return mem
    chunk = loss_chunk(m, lay, mem)
    return replace(mem, loss_chunk=chunk, loss_buffers=act.loss_transient_bytes(m, lay, tokens, head_reduce, chunk))


def autocast_cast(tensors: list, precision: PrecisionConfig) -> list:
    """The matmul weights autocast copies: not those float8 converts (torchao's Float8Linear casts the fp32 weight
    to float8 itself and saves the fp32 parameter for backward, no compute-dtype copy; core/float8.py's rule)."""
    if not precision.fp8:
        return tensors
    return [t for t in tensors if not (t.is_matmul and converts(
        precision.fp8_filter, precision.fp8_recipe, t.name.removesuffix(".weight"), t.rows, t.cols,
        precision.fp8_exclude))]


def loss_chunk(m: ModelConfig, lay: act.ActLayout, unchunked: RankMemory) -> int:
    """Tokens per chunk of the loss head: as many as fit under the step's other phases' peak, so the loss never
    becomes the peak by its chunks (core/loss_head.planned_chunk_tokens); `unchunked` counts no chunk."""
    phases = unchunked.phases()
    others = max(v for k, v in phases.items() if k != "loss")
    room = others - (phases["loss"] - unchunked.loss_buffers + act.loss_accumulator_bytes(m, lay))
    return planned_chunk_tokens(m.vocab_size, m.dim, unchunked.tokens_per_micro_batch, room, lay.compute_bytes)
