"""Per-rank device memory at its peak, broken down, following what the worker does.

Model states are counted tensor by tensor (trainctl/plan/shapes.py), so the predicted parameter,
gradient and optimizer bytes are those of the live tensors on each rank (tests/dist checks it):

    strategy          weights (fp32)      grads (fp32, after backward)   optimizer (core/optimizers.py)
    none, ddp         local               local                          local
    zero1             local               local                          ZeroRedundancyOptimizer's
                                                                         whole-tensor partition
    zero2, zero3,     FSDP2 shard of      FSDP2 shard                    FSDP2 shard
    hsdp              dp_shard (rank 0's chunk, the largest)
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
- cpu_offload moves weights, gradients and optimizer states to host memory; the device keeps
  the gathered units and their gradients.
- The optimizer step: its temporaries are the optimizer's (core/optimizers.py): fused AdamW on CUDA
  allocates nothing; the foreach AdamW used elsewhere (CPU, or CUDA parameters under cpu_offload
  run on the host) allocates one fp32 temporary per stepped element.
Phases: the peak is the largest of (loss) the start of backward, (block) the first block's
backward, (end) the end of backward, and (step) the optimizer step; each phase lists what is
alive then. Gradients are conservatively counted as fully present from the end of backward on,
and at the loss only when grad_accum > 1 (earlier micro-batches' gradients are there).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from trainctl.config.schema import ModelConfig, PrecisionConfig, ShardingConfig, TrainConfig
from trainctl.core import optimizers
from trainctl.core.dims import ParallelDims
from trainctl.core.lora import is_adapter
from trainctl.core.loss_head import chunked_loss
from trainctl.core.wrapping import Wrapping, float8_all_gather, wrapping
from trainctl.plan import activations as act
from trainctl.plan.shapes import (
    Tensor,
    block_tensors,
    embedding_tensor,
    fsdp_local_numel,
    fsdp_rows,
    head_tensors,
    stage_tensors,
    tp_local,
    zero1_assignment,
)
from trainctl.plan.stages import RankStages

FP32 = 4
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
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
        base = self.params + self.optimizer + self.ddp_buckets
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
        counts = ("pp_rank", "tokens_per_micro_batch", "in_flight", "local_params")
        data = {k: v for k, v in asdict(self).items() if k not in counts}
        out = {f"{k}_bytes": v for k, v in data.items()}
        out["states_bytes"] = self.states
        out["phases_bytes"] = self.phases()
        out["peak_bytes"] = self.peak
        out["peak_phase"] = self.peak_phase
        out.update(pp_rank=self.pp_rank, tokens_per_micro_batch=self.tokens_per_micro_batch, in_flight=self.in_flight,
                   local_params=self.local_params)
        return out


def local_tensors(m: ModelConfig, stage: RankStages, tp: int) -> list[Tensor]:
    return [tp_local(t, tp, m.family) for t in stage_tensors(m, stage.layers, stage.first, stage.last)]


def stepped_tensors(tensors: list[Tensor], wrap: Wrapping, dims: ParallelDims, dp_rank: int = 0) -> list[Tensor]:
    """The (local) tensors whose optimizer states data-parallel rank `dp_rank` holds and steps.

    FSDP2: each tensor's dim-0 chunk (rank 0's are the full ones); zero1: the whole tensors of
    ZeroRedundancyOptimizer's partition; otherwise every tensor.
    """
    if wrap.fsdp:
        shard_rank = dp_rank % dims.dp_shard
        return [Tensor(t.name, fsdp_rows(t.rows, dims.dp_shard, shard_rank), t.cols) for t in tensors]
    if wrap.zero1:
        return zero1_assignment(tensors, dims.dp_replicate)[dp_rank]
    return tensors


def stored_elements(
    tensors: list[Tensor], wrap: Wrapping, dims: ParallelDims, dp_rank: int = 0
) -> tuple[int, int, int]:
    """(weight/gradient elements, optimizer elements, stepped tensors) that data-parallel rank `dp_rank` stores."""
    stepped = [t.numel for t in stepped_tensors(tensors, wrap, dims, dp_rank)]
    full = sum(stepped) if wrap.fsdp else sum(t.numel for t in tensors)
    return full, sum(stepped), sum(1 for n in stepped if n > 0)


def stored_of(tensors: list[Tensor], wrap: Wrapping, dims: ParallelDims) -> int:
    """Elements of `tensors` rank 0 stores (their gradients' share)."""
    if wrap.fsdp:
        return sum(fsdp_local_numel(t, dims.dp_shard) for t in tensors)
    return sum(t.numel for t in tensors)


def busiest_dp_rank(tensors: list[Tensor], wrap: Wrapping, dims: ParallelDims, optim: str = "adamw") -> int:
    """Rank 0 under FSDP2 (the first chunks are the full ones); under zero1 the rank with the most state bytes."""
    if wrap.zero1:
        shares = [optimizers.state_bytes(optim, mine) for mine in zero1_assignment(tensors, dims.dp_replicate)]
        return shares.index(max(shares))
    return 0


def model_states(
    m: ModelConfig, sharding: ShardingConfig, dims: ParallelDims, stage: RankStages, dp_rank: int,
    optim: str = "adamw",
) -> dict[str, int]:
    """Bytes of the live parameter, gradient and optimizer tensors on one rank (what memory_stats measures)."""
    tensors = local_tensors(m, stage, dims.tp)
    wrap = wrapping(sharding.strategy, dims)
    stored = stored_elements(tensors, wrap, dims, dp_rank)[0]
    optimizer = optimizers.state_bytes(optim, stepped_tensors(trainable(tensors), wrap, dims, dp_rank))
    grads = stored_of(trainable(tensors), wrap, dims)
    return {"params_bytes": FP32 * stored, "grads_bytes": FP32 * grads, "optimizer_bytes": optimizer}


def trainable(tensors: list[Tensor]) -> list[Tensor]:
    """The tensors that get gradients and optimizer states: LoRA's adapters when there are any, else all."""
    adapters = [t for t in tensors if is_adapter(t.name)]
    return adapters or tensors


def trainable_of(part: list[Tensor], learn: list[Tensor]) -> list[Tensor]:
    names = {t.name for t in learn}
    return [t for t in part if t.name in names]


def fsdp_units(m: ModelConfig, stage: RankStages, tp: int) -> dict[str, int]:
    """Elements of each FSDP2 unit (parallelize.apply_fsdp), tp-local: embedding, one block, head, root."""
    def numel(ts: list[Tensor]) -> int:
        return sum(tp_local(t, tp, m.family).numel for t in ts)

    tied = m.tie_embeddings and stage.first and stage.last
    block = numel(block_tensors(m, stage.layers[0])) if stage.layers else 0
    embedding = numel([embedding_tensor(m)]) if stage.first else 0
    head = numel(head_tensors(m, stage.first)) if stage.last else 0
    if tied:  # one parameter at both ends: it stays in the root unit, with the final norm
        return {"embedding": 0, "block": block, "head": 0, "root": embedding + head}
    return {"embedding": embedding, "block": block, "head": head, "root": 0}


def gathered(units: dict[str, int], n_blocks: int, reshard: bool, c: int, r: int,
             g: int | None = None) -> tuple[int, int, int]:
    """(at the loss, during a block's backward, at the end of backward) bytes of FSDP2's gathered units.

    A unit's backward holds its gathered weights (g bytes per element: the compute dtype's c, or 1 for a
    block's float8 all-gather), its unsharded gradient (compute dtype) and the reduce-scatter input (reduce
    dtype): (g + c + r) per element; a block's backward also has the previous block prefetched (+g). A block's
    norm weights gather in the compute dtype under float8 too (2 dim of about 12 dim^2: left out).
    """
    g = c if g is None else g
    block, root, embedding = units["block"], units["root"], units["embedding"]
    at_end = c * root + max((2 * c + r) * embedding, (g + c + r) * block)
    if reshard:
        return c * (units["head"] + root), c * root + (2 * g + c + r) * block, at_end
    kept = c * (embedding + units["head"] + root) + g * n_blocks * block  # zero2: all kept until their backward
    return kept, kept + (c + r) * block, at_end


def activation_layout(precision: PrecisionConfig, wrap: Wrapping, dims: ParallelDims,
                      chunked_loss: bool = False, compiled: bool = False, device: str = "cpu") -> act.ActLayout:
    c = DTYPE_BYTES[precision.compute_dtype]
    # Under FSDP mixed precision the weights (so the embedding's output) are in the compute dtype;
    # autocast leaves the embedding fp32 and the residual adds promote to fp32.
    residual = c if wrap.fsdp else FP32
    return act.ActLayout(c, residual, dims.tp, dims.cp, wrap.autocast, chunked_loss, compiled,
                         fused_norm=device == "cuda")


@dataclass(frozen=True)
class SavedActivations:
    one: int  # one micro-batch, head included
    everything: int  # every micro-batch in flight
    head: int  # the head's part (all in flight)
    first_block: int  # the first block's (and the token ids') part of everything
    host: int = 0  # moved to host memory by activation offload
    unpacked: int = 0  # offloaded tensors copied back to the device for one block's backward


def activation_bytes(
    m: ModelConfig, train: TrainConfig, lay: act.ActLayout, stage: RankStages, tokens: int
) -> SavedActivations:
    """Activations saved for backward on this rank."""
    mode, n_blocks = train.activation_checkpointing, len(stage.layers)
    blocks = act.blocks_bytes(m, lay, mode, n_blocks, train.ac_every) * tokens
    ids = act.TOKEN_ID_BYTES * tokens if stage.first else 0
    if mode != "selective":
        first = act.blocks_bytes(m, lay, mode, 1, train.ac_every) * tokens
    else:
        first = blocks / max(1, n_blocks)
    head = int(act.head_bytes(m, lay) * tokens) + act.head_fixed_bytes(m, lay) if stage.last else 0
    # A pipeline's last stage also keeps its output logits (the schedule's forward cache) until backward.
    if stage.last and n_blocks < m.n_layers:
        head += lay.compute_bytes * m.vocab_size * tokens
    one = int(blocks + ids)
    everything = int(one * stage.in_flight) + head * stage.last_in_flight
    first_block = everything - head * stage.last_in_flight - one + int(first + ids)
    return SavedActivations(one + head, everything, head * stage.last_in_flight, first_block)


def offloaded(
    saved: SavedActivations, m: ModelConfig, lay: act.ActLayout, train: TrainConfig, stage: RankStages, tokens: int
) -> SavedActivations:
    """train.activation_offload: every saved tensor goes to host memory (torch's save_on_cpu).

    What op-level checkpointing caches (the matmul outputs) is kept by checkpointing itself, not
    saved through autograd's hooks: it stays on the device. In backward each block's tensors come
    back to the device one block at a time.
    """
    wrapped = act.checkpointed_blocks(train.activation_checkpointing, len(stage.layers), train.ac_every)
    cache = (act.block_op(m, lay) - act.block_full(m, lay)) * wrapped if train.activation_checkpointing == "op" else 0
    on_device = int(cache * tokens * stage.in_flight)
    unpacked = int(act.block_none(m, lay) * tokens)
    return SavedActivations(saved.one, on_device, 0, on_device, saved.everything - on_device, unpacked)


def weight_cast_bytes(tensors: list[Tensor], stage: RankStages, c: int, wrapped: int, chunked_loss: bool) -> int:
    """torch.autocast's compute-dtype copies of the matmul weights, kept for backward (not in checkpointed blocks).

    The chunked loss keeps its weight gradient instead of the output weight's copy (activations count it).
    """
    block_matmul = sum(t.numel for t in tensors if t.is_matmul and t.name.startswith("layers."))
    per_block = block_matmul // max(1, len(stage.layers))
    head_matmul = sum(t.numel for t in tensors if t.is_matmul and not t.name.startswith("layers.")
                      and not (chunked_loss and t.name.startswith("output.")))
    return c * (per_block * (len(stage.layers) - wrapped) + head_matmul)


def end_parts(tensors: list[Tensor], stage: RankStages) -> tuple[list[Tensor], list[Tensor]]:
    """(embedding + first block, norm + output): the tensors whose gradients come last and first in backward."""
    first_block = f"layers.{stage.layers[0]}." if stage.layers else None
    first_part = [t for t in tensors
                  if t.name.startswith("tok_embeddings") or (first_block and t.name.startswith(first_block))]
    head_part = [t for t in tensors if t.name.startswith(("norm.", "output."))]
    return first_part, head_part


def head_reduce_bytes(m: ModelConfig, stage: RankStages, dims: ParallelDims, wrap: Wrapping, r: int) -> int:
    """FSDP2's reduce-scatter input for the head's own unit at its post-backward (the loss phase); 0 otherwise."""
    if not (wrap.fully_shard and stage.last):
        return 0
    return (r if wrap.fsdp else FP32) * fsdp_units(m, stage, dims.tp)["head"]


def gathered_bytes(m: ModelConfig, stage: RankStages, dims: ParallelDims, wrap: Wrapping, c: int, r: int,
                   precision: PrecisionConfig | None = None):
    """`gathered` for this wrapping's FSDP2 units; zeros without FSDP2."""
    if not wrap.fully_shard:
        return 0, 0, 0
    units = fsdp_units(m, stage, dims.tp)
    # FSDP2 as DDP (ddp over tp/pp) gathers and reduces fp32: it has no mixed precision.
    unit_c, unit_r = (c, r) if wrap.fsdp else (FP32, FP32)
    g = 1 if float8_all_gather(wrap.fsdp, precision) else unit_c
    return gathered(units, len(stage.layers), wrap.reshard_after_forward, unit_c, unit_r, g)


def estimate(m: ModelConfig, precision: PrecisionConfig, sharding: ShardingConfig, train: TrainConfig,
             dims: ParallelDims, stage: RankStages, device: str = "cuda", optim: str = "adamw") -> RankMemory:
    """Per-rank memory of one pipeline rank's stage (module doc), for a resolved layout and optimizer (optim.name)."""
    wrap = wrapping(sharding.strategy, dims, precision)
    c, r = DTYPE_BYTES[precision.compute_dtype], DTYPE_BYTES[precision.reduce_dtype]
    tensors = local_tensors(m, stage, dims.tp)
    local = sum(t.numel for t in tensors)
    learn = trainable(tensors)  # with LoRA only the adapters have gradients, DDP buckets and optimizer states
    learn_local = sum(t.numel for t in learn)
    stored = stored_elements(tensors, wrap, dims, busiest_dp_rank(tensors, wrap, dims, optim))[0]
    stepped = stepped_tensors(learn, wrap, dims, busiest_dp_rank(learn, wrap, dims, optim))
    fsdp = wrap.fully_shard
    params, grads = FP32 * stored, FP32 * stored_of(learn, wrap, dims)
    optimizer = optimizers.state_bytes(optim, stepped)
    tokens = train.micro_batch * train.seq_len // dims.cp
    lay = activation_layout(precision, wrap, dims, chunked_loss(m, precision, dims.tp, dims.pp), train.compile,
                            device)
    saved = activation_bytes(m, train, lay, stage, tokens)
    if train.activation_offload:
        saved = offloaded(saved, m, lay, train, stage, tokens)
    mode = train.activation_checkpointing
    wrapped = act.checkpointed_blocks(mode, len(stage.layers), train.ac_every)
    casts = weight_cast_bytes(tensors, stage, c, wrapped, lay.chunked_loss) if lay.autocast else 0
    first_part, head_part = end_parts(tensors, stage)
    at_loss, during_block, at_end = gathered_bytes(m, stage, dims, wrap, c, r, precision)
    accumulating = train.grad_accum > 1
    unsharded = max(c, r) * learn_local if fsdp and accumulating else 0
    step_temp = optimizers.spec(optim).step_temp_bytes(stepped, device == "cuda" and not sharding.cpu_offload)
    host = saved.host
    if sharding.cpu_offload:
        host, params, grads, optimizer, step_temp = host + params + grads + optimizer, 0, 0, 0, 0
    return RankMemory(
        pp_rank=stage.pp_rank,
        params=params,
        grads=grads,
        optimizer=optimizer,
        ddp_buckets=FP32 * learn_local if wrap.ddp else 0,
        host=host,
        gathered_loss=at_loss,
        gathered_block=during_block,
        gathered_end=at_end,
        unsharded_grads=unsharded,
        accumulated_grads=grads if accumulating and not fsdp else 0,
        weight_casts=casts,
        activations=saved.everything,
        activations_per_micro_batch=saved.one,
        loss_buffers=(act.loss_transient_bytes(m, lay, tokens, head_reduce_bytes(m, stage, dims, wrap, r))
                      if stage.last else 0),
        recompute=(int(act.recompute_bytes(m, lay, mode) * tokens) if wrapped else 0) + saved.unpacked,
        grad_temp=int(act.block_grad_bytes(m, lay) * tokens) if stage.layers else 0,
        head_activations=saved.head,
        last_block_activations=saved.first_block,
        grads_head=0 if sharding.cpu_offload else FP32 * stored_of(trainable_of(head_part, learn), wrap, dims),
        grads_tail=0 if sharding.cpu_offload else grads - FP32 * stored_of(trainable_of(first_part, learn), wrap, dims),
        step_temp=step_temp,
        tokens_per_micro_batch=tokens,
        in_flight=stage.in_flight,
        local_params=local,
    )
