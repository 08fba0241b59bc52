"""The plan's `notes`: where the worker differs from the textbook formula, for this config only.

Each note names the item of the breakdown it explains and why it is what it is; the numbers
behind them are in memory.py, activations.py, fit.py and throughput.py.
"""

from __future__ import annotations

from trainctl.config.schema import RunConfig
from trainctl.core import nf4, optimizers
from trainctl.core.dims import ParallelDims
from trainctl.core.gpus import MFU_FORMULA
from trainctl.core.lora import expert_targets, target_paths
from trainctl.core.loss_head import chunked_loss
from trainctl.core.tensors import GROUPED_MM_ROW_BYTES
from trainctl.core.wrapping import shards_parameters, wrapping
from trainctl.plan import fit as fitting
from trainctl.plan import throughput as tp_model
from trainctl.plan.attention_kernel import predicted_kernel
from trainctl.plan.experts import expert_share
from trainctl.plan.flops import linear_shapes
from trainctl.plan.memory import GIB, RankMemory
from trainctl.plan.throughput import DEFAULT_MFU
from trainctl.plan.transients import DTYPE_BYTES


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def strategy_notes(cfg: RunConfig, dims: ParallelDims, mem: RankMemory) -> list[str]:
    t, wrap = cfg.train, wrapping(cfg.sharding.strategy, dims, cfg.precision)
    notes = []
    if mem.ddp_buckets:
        notes.append(f"ddp_buckets {_gib(mem.ddp_buckets)}: DDP keeps flat fp32 gradient buckets beside .grad "
                     "(gradient_as_bucket_view=False), so replicated gradients cost 8 bytes/param, not 4")
    if wrap.zero1 and dims.dp_replicate > 1:
        notes.append("optimizer (zero1): ZeroRedundancyOptimizer gives whole tensors to ranks (largest first), "
                     "so the busiest rank holds more than 1/dp of the optimizer states")
    if wrap.fsdp and not wrap.reshard_after_forward:
        notes.append("gathered_loss (zero2): FSDP2 with reshard_after_forward=False keeps every unit gathered from its "
                     "forward to its backward: a compute-dtype copy of the whole stage at the start of backward")
    if wrap.fsdp and wrap.reshard_after_forward:
        notes.append("gathered (zero3): blocks are re-gathered for backward; norm + output (and a tied embedding, in "
                     "the "
                     "root unit) stay gathered from forward to backward")
    if mem.unsharded_grads:
        notes.append(f"unsharded_grads {_gib(mem.unsharded_grads)}: with grad_accum={t.grad_accum} FSDP2 skips the "
                     "reduce-scatter until the last micro-batch and keeps unsharded gradients (reduce dtype) in "
                     "between: "
                     "ZeRO's gradient saving is gone until then; fewer, larger micro-batches avoid it")
    if wrap.fsdp_as_ddp:
        notes.append("ddp over tp/pp: the worker replicates with FSDP2 on a shard group of one (DDP cannot bucket "
                     "DTensors): an fp32 unsharded copy of each unit is gathered as for zero2")
    if mem.weight_casts:
        notes.append(f"weight_casts {_gib(mem.weight_casts)}: torch.autocast keeps a compute-dtype copy of every "
                     "matmul "
                     "weight it used, saved for backward (checkpointed blocks re-cast instead); FSDP's mixed precision "
                     "would gather bf16 weights per unit instead of casting the whole model")
    if cfg.sharding.cpu_offload:
        notes.append(f"host {_gib(mem.host)}: cpu_offload keeps weights, gradients and AdamW states in host memory; "
                     "the "
                     "device holds the gathered units and their unsharded gradients; the step runs AdamW on the host")
    return notes


def document_mask_note(cfg: RunConfig) -> str:
    """SDPA's block-causal mask is dense: its bytes grow with seq^2, outside the activation formula."""
    t, c = cfg.train, cfg.precision.compute_dtype
    square = t.micro_batch * t.seq_len**2
    bias = square * (4 if c == "fp32" else 2) * cfg.model.n_layers
    return (f"document_mask: SDPA gets a boolean [micro_batch, 1, seq, seq] mask per micro-batch "
            f"({_gib(square)}); on CUDA it rules out the flash and cuDNN kernels, and the memory-efficient one turns "
            f"it into a {c} bias that each block keeps for backward (~{_gib(bias)} over {cfg.model.n_layers} blocks, "
            "not counted above); a shorter train.seq_len or micro_batch shrinks both")


def activation_notes(cfg: RunConfig, dims: ParallelDims, mem: RankMemory) -> list[str]:
    t, s = cfg.train, cfg.sharding
    if not mem.loss_buffers:
        notes = []
    elif chunked_loss(cfg.model, cfg.precision, dims.tp, dims.pp):
        chunk = mem.loss_chunk
        notes = [f"loss_buffers {_gib(mem.loss_buffers)}: the output projection and cross-entropy run in chunks of "
                 f"{chunk} tokens, computing their gradients in forward: no fp32 "
                 "[tokens, vocab] tensor is ever whole; the head keeps the input's and the weight's gradients"]
    else:
        notes = [f"loss_buffers {_gib(mem.loss_buffers)}: the dense loss (tp, pp or a float8 output layer): "
                 "log_softmax saves fp32 [tokens, vocab] and backward adds two more fp32 [tokens, vocab] gradients "
                 "(the largest transient for a large vocabulary; fewer tokens per micro-batch shrink it)"]
    if dims.tp > 1:
        notes.append("tp: the output projection gathers full logits (no loss parallelism), so every tp rank holds the "
                     "whole vocabulary's loss buffers; column-parallel matmuls save the all-gathered sequence (2 a d "
                     "per "
                     "token per block, not divided by tp)")
    if dims.cp > 1:
        notes.append("cp: tokens per rank are divided by cp, and k/v are counted with n_heads (the worker repeats the "
                     "kv heads for the ring kernels)")
    if dims.pp > 1:
        notes.append(f"pp: schedule {s.pp_schedule} keeps {mem.in_flight:g} micro-batches of this rank's activations "
                     "alive at once (trainctl/plan/stages.py); the last stage also keeps its output logits until "
                     "backward")
    if cfg.data.document_mask:
        notes.append(document_mask_note(cfg))
    if t.activation_checkpointing == "op":
        notes.append("op checkpointing keeps matmul and attention outputs; the row-parallel outputs (wo, w2) are full "
                     "size under tp (partial sums before the reduce-scatter)")
    if t.activation_offload:
        notes.append("activation_offload: saved tensors live in host memory until backward (the op-level cache stays "
                     "on the device); one block's tensors come back at a time")
    if cfg.precision.fp8:
        recipe = cfg.precision.fp8_recipe
        share = tp_model.fp8_share(cfg.model, t.seq_len, cfg.precision.fp8_exclude, recipe, cfg.precision.fp8_filter)
        notes.append(f"fp8: float8 matmuls run {share:.0%} of the model FLOPs (the converted Linears); attention and "
                     f"{', '.join(cfg.precision.fp8_exclude) or 'nothing else'} stay bf16; compute modelled at "
                     f"{tp_model.FP8_GEMM_EFFICIENCY.get(recipe, 1.0):g} x the fp8/bf16 peak ratio on that share "
                     f"({recipe}, measured on NVIDIA H200 at the Llama 3.2 1B shape); MFU stays against the bf16 peak")
        notes.append("fp8: torchao's Float8Linear saves the bf16 input and weight and re-casts in backward, so "
                     "activations are counted as bf16; its transient fp8 copies (1 byte per element of one layer) are "
                     "not; FSDP's float8 all-gather (tensorwise) gathers 1 byte per block weight element")
    if t.compile:
        notes.append("compile: estimates follow the eager ops; inductor's fused kernels usually save less, so the "
                     "prediction errs high")
    return notes


def device_notes(cfg: RunConfig, dims: ParallelDims) -> list[str]:
    kernel, why = predicted_kernel(cfg)
    attention = f"attention kernel: {kernel} ({why}; train.attention=flash leaves cuDNN out)"
    return [attention, *_framework_notes(cfg, dims)]


def _framework_notes(cfg: RunConfig, dims: ParallelDims) -> list[str]:
    if cfg.cluster.device != "cuda":
        return [f"framework: {fitting.CPU_PROCESS_BYTES / GIB:.1f} GiB per worker process (interpreter, libraries); "
                "capacity: this machine's memory over procs_per_node for a local launch"]
    groups = sum(1 for size in dims.as_dict().values() if size > 1)
    return [f"framework: CUDA context and workspaces {fitting.CUDA_CONTEXT_BYTES / GIB:.2f} GiB + NCCL "
            f"{fitting.NCCL_BYTES_PER_DIM / GIB:.2f} GiB x {groups} parallel dims + {fitting.FRAGMENTATION:.0%} of the "
            "peak for "
            "allocator fragmentation; none of it is in torch.cuda.max_memory_allocated"]


def throughput_notes(cfg: RunConfig) -> list[str]:
    source = ("cluster.assumed_mfu" if cfg.cluster.assumed_mfu
              else "the default: no measured figure under benchmarks/ yet")
    return [f"step time at MFU {cfg.cluster.assumed_mfu or DEFAULT_MFU:g} ({source}; {MFU_FORMULA}); recompute, "
            "pipeline bubble, "
            "exposed TP/FSDP "
            "traffic and offload transfers are added as trainctl/plan/throughput.py states (full checkpointing: one "
            "more "
            "forward of the wrapped blocks, about +1/3 of their FLOPs; op: +3% for re-run pointwise ops)"]


def lora_notes(cfg: RunConfig) -> list[str]:
    lora = cfg.model.lora
    if lora.rank <= 0:
        return []
    return [f"LoRA (rank {lora.rank} on {','.join(lora.targets)}): grads, ddp_buckets and optimizer count the "
            "adapters only; activations and FSDP's gathered gradients are counted as for full training (an upper "
            "bound: autograd saves no input for a frozen projection without an adapter), and FLOPs/MFU count the "
            "full 6N though frozen weights compute no weight gradient"] + nf4_notes(cfg.model, cfg.sharding)


def nf4_notes(m, sharding) -> list[str]:
    """QLoRA's base: what params counts for it, and the load that precedes the quantization."""
    if not nf4.enabled(m.lora):
        return []
    held = ("sharded by rows over the FSDP2 ranks" if shards_parameters(sharding.strategy)
            else "whole on every rank")
    shapes = linear_shapes(m)
    numel = m.n_layers * sum(shapes[p][0] * shapes[p][1] for p in target_paths(m.lora))
    return [f"QLoRA (model.lora.base_dtype=nf4): params counts the {numel:,} adapted weights as torchao NF4 "
            f"({nf4.tensor_bytes(numel) / 2**20:.1f} MiB for all layers: 4 bits each, an int8 scale per {nf4.BLOCK} "
            f"and an fp32 factor per {nf4.QUANTUM}; {4 * numel / 2**20:.1f} MiB in fp32), "
            f"{held}; the worker quantizes each whole once loaded, so the load briefly holds it in fp32"]


def optimizer_notes(cfg: RunConfig, mem: RankMemory) -> list[str]:
    """What `optimizer` holds when it is not AdamW's two moments (the default every other figure assumes)."""
    if cfg.optim.name == "adamw":
        return []
    return [f"optimizer {_gib(mem.optimizer)} ({cfg.optim.name}): {optimizers.spec(cfg.optim.name).summary}, "
            "counted tensor by tensor"]


def expert_notes(cfg: RunConfig, dims: ParallelDims, mem: RankMemory) -> list[str]:
    """Under expert parallelism: the experts each rank holds and gathers, and the all-to-all (plan/experts.py);
    under tensor parallelism: that the experts are not split by it."""
    if cfg.model.moe.num_experts and dims.tp > 1 and dims.ep == 1:
        return [f"experts (tp={dims.tp}): the router and every expert are whole on each tp rank (only attention, "
                "the embedding and the output are split); each rank routes its own seq/tp tokens, so no "
                "activation is gathered for the MoE MLP"]
    if dims.ep == 1 or cfg.model.moe.num_experts == 0:
        return []
    t, c = cfg.train, DTYPE_BYTES[cfg.precision.compute_dtype]
    wrap = wrapping(cfg.sharding.strategy, dims, cfg.precision)
    share = expert_share(cfg.model, dims, wrap, cfg.model.n_layers // dims.pp, mem.tokens_per_micro_batch, c,
                         t.grad_accum, t.activation_checkpointing == "full", cfg.optim)
    return [f"experts (ep={dims.ep}): each rank computes {share.experts_per_rank} of {cfg.model.moe.num_experts} "
            f"experts per layer and gathers {_gib(share.gathered_bytes)} of them per layer (FSDP2 over "
            f"dp_shard/ep={dims.efsdp}); the token all-to-alls move {_gib(int(share.all_to_all_bytes))} per step "
            "each way, not overlapped (step time's ep_comm_s)"
            + (f"; they are whole and replicated over tp={dims.tp}, each tp rank exchanging its own seq/tp tokens "
               "with the ep peers of its tp coordinate" if dims.tp > 1 else "")]


def expert_kernel_notes(cfg: RunConfig) -> list[str]:
    """On CUDA, whether the routed experts run as one grouped matmul or as a loop of one matmul per expert
    (models/common/experts.py): the kernel takes bf16 operands whose rows are 16-byte aligned (widths multiple of 8)."""
    m = cfg.model
    if not m.moe.num_experts or cfg.cluster.device != "cuda":
        return []
    widths = {"model.dim": m.dim, "model.moe.expert_ffn_dim": m.moe.expert_ffn_dim}
    if expert_targets(m.lora):
        widths["model.lora.rank"] = m.lora.rank
    multiple = GROUPED_MM_ROW_BYTES // DTYPE_BYTES["bf16"]
    unaligned = [f"{key}={value}" for key, value in widths.items() if value % multiple]
    if cfg.precision.compute_dtype != "bf16":
        why = f"precision.compute_dtype={cfg.precision.compute_dtype}: the kernel takes bf16"
    elif unaligned:
        why = (f"{', '.join(unaligned)}: its widths must be multiples of {multiple}, "
               f"{GROUPED_MM_ROW_BYTES}-byte rows in bf16")
    else:
        return ["experts: one grouped matmul (torch._grouped_mm) per projection for all of a rank's experts"]
    return [f"experts: a loop of one matmul per expert, not the grouped kernel ({why}); slower with many experts"]


def notes_for(cfg: RunConfig, dims: ParallelDims, mem: RankMemory) -> list[str]:
    """Every note that applies to this config, strategy first."""
    return (strategy_notes(cfg, dims, mem) + optimizer_notes(cfg, mem) + activation_notes(cfg, dims, mem)
            + expert_notes(cfg, dims, mem) + expert_kernel_notes(cfg) + device_notes(cfg, dims) + lora_notes(cfg)
            + throughput_notes(cfg))
