"""Turn the meta-device model into the trained one: one `parallelize` with a fixed order.

The order matters and is the same as torchtitan's:
  pipeline split (first: later steps see only this stage's layers)
  -> float8 (swaps Linears for torchao Float8Linear; before TP, so that TP can use torchao's
     float8 styles and shard the Float8Linear itself -- converting already-sharded Linears
     would drop TP's input/output hooks)
  -> tensor parallel (swaps Linear weights for DTensors on the tp mesh)
  -> expert parallel (every GroupedExperts' stacked weights Shard(0) over the ep mesh; all-to-all around them)
  -> activation checkpointing (wraps blocks; must wrap what FSDP will shard)
  -> compile (per block, around the checkpointed block)
  -> QLoRA's base as NF4 on the meta device (before fully_shard: see quantize_before_sharding)
  -> FSDP2 fully_shard (under ep the experts first, over efsdp; then per block, then the root)
  -> materialize: to_empty + init_weights (every shard inits its own slice; an NF4 one its rows of the
     whole weight quantized)
  -> DDP (last: it needs real weights and broadcasts rank 0's).
Context parallelism changes no module except attention's kv heads: it shards each step's
sequences (context_parallel.py) and joins the cp ranks to data parallelism for gradients.
What is not implemented is refused up front by `check_supported`, one line naming the key.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sysconfig
from functools import partial
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from trainctl.config.schema import PrecisionConfig, ShardingConfig, TrainConfig
from trainctl.core.errors import UserError
from trainctl.core.support import unsupported
from trainctl.core.wrapping import wrapping_of
from trainctl.models.build import family_parallel
from trainctl.models.lora import init_adapters
from trainctl.models.qlora import quantize_base
from trainctl.train.errors import WorkerConfigError
from trainctl.train.inductor_isa import pin_cpu_vector_isa
from trainctl.train.parallel.activations import apply_activation_checkpointing, transformer_blocks
from trainctl.train.parallel.context_parallel import expand_kv_heads_for_cp
from trainctl.train.parallel.expert import apply_expert_parallel, expert_dp_mesh, shard_experts
from trainctl.train.parallel.float8 import apply_float8
from trainctl.train.parallel.precision import fsdp_mp_policy
from trainctl.train.parallel.tensor_parallel import apply_replicate_over_tp, apply_tp


def check_supported(sharding: ShardingConfig, precision: PrecisionConfig) -> None:
    """Refuse, before any work, what this worker does not implement yet (the launcher refuses it too)."""
    missing = unsupported(sharding, precision)
    if missing:
        raise WorkerConfigError("; ".join(missing))


def check_compiler(env: dict | None = None) -> None:
    """torch.compile on CUDA builds Triton's launcher with a C compiler and Python's headers: refuse up front
    (one line) where they are missing, instead of dying at the first forward."""
    env = os.environ if env is None else env
    compiler = env.get("CC") or next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    missing = ([] if compiler and shutil.which(compiler.split()[0]) else ["a C compiler (cc, gcc or clang; or $CC)"])
    missing += [] if headers.exists() else [f"Python's headers ({headers})"]
    if missing:
        raise WorkerConfigError(
            f"train.compile=true: Triton needs {' and '.join(missing)} on this node; install gcc and "
            f"python{sysconfig.get_python_version()}-dev (or your distribution's equivalent), "
            "or set train.compile=false")


def apply_compile(model: nn.Module) -> None:
    """torch.compile each block: same code per block, so one compiled graph is reused by all.

    fullgraph=True: a graph break fails loudly at the first step instead of silently splitting the block into
    slower pieces.
    """
    pin_cpu_vector_isa()
    blocks = transformer_blocks(model)
    for name, block in list(blocks.items()):
        blocks[name] = torch.compile(block, fullgraph=True)


def dp_mesh_for(dp_dims: tuple[str, ...], mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel sub-mesh over the wrapping's `dp_mesh` dims (replicate, shard, or both).

    Under context parallelism the cp ranks hold the same parameters and see different tokens,
    so they join data parallelism for the gradients (dims flattened by `flatten_dp_cp`).
    """
    if mesh["cp"].size() > 1:
        dp_dims = ("dp_cp",) if dp_dims == ("dp_replicate",) else tuple(
            "dp_shard_cp" if name == "dp_shard" else name for name in dp_dims)
    return mesh[dp_dims[0]] if len(dp_dims) == 1 else mesh[dp_dims]


def apply_fsdp(
    model: nn.Module, dp_mesh: DeviceMesh, reshard_after_forward: bool, mp_policy: MixedPrecisionPolicy,
    cpu_offload: bool = False,
) -> None:
    """fully_shard the family's units (models/<family>/parallel.fsdp_units: for llama the embedding, each block,
    and norm + output), then the root.

    Separate units let FSDP all-gather a large vocabulary matrix only around its own use and
    free it afterwards. cpu_offload: the sharded parameters, their gradients (hence the optimizer step
    and its states) live in host memory; each unit is copied to the device for its all-gather.
    """
    # Pinned host memory makes the host-device copies asynchronous; it needs a CUDA runtime.
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    shard = partial(fully_shard, mesh=dp_mesh, mp_policy=mp_policy, offload_policy=offload)
    for unit, may_reshard in family_parallel(model.cfg).fsdp_units(model, transformer_blocks(model)):
        shard(unit, reshard_after_forward=reshard_after_forward and may_reshard)
    shard(model, reshard_after_forward=False)


def quantize_before_sharding(model: nn.Module) -> None:
    """model.lora.base_dtype=nf4 under FSDP2: the adapted weights become NF4 on the meta device, then fully_shard
    shards them as NF4 (torchao implements the chunk, new_zeros and copy_ that FSDP2's sharding runs on an
    NF4Tensor, and its all-gather extension). Not after: FSDP2 re-reads a parameter swapped after fully_shard
    through its storage, which an NF4 wrapper has none of. The values come at init or load (models/common/
    quantized.py: each rank's rows of the whole weight quantized, what one process holds)."""
    try:
        quantize_base(model, model.cfg.lora)
    except UserError as exc:  # torchao missing: one line naming the key and the install
        raise WorkerConfigError(str(exc)) from None


def materialize(model: nn.Module, device: torch.device, cpu_offload: bool = False) -> None:
    """Allocate real (possibly sharded) storage on `device` and run the model's deterministic init.

    With FSDP2 CPU offload the parameters must be materialized in host memory (FSDP2 refuses
    device ones); only the buffers (the RoPE table) go to `device`, where the forward runs.
    """
    model.to_empty(device="cpu" if cpu_offload else device)
    model.init_weights()
    init_adapters(model)  # LoRA's A and B (none without model.lora)
    if cpu_offload:
        move_buffers(model, device)


def move_buffers(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            setattr(module, name, buffer.to(device))


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, device: torch.device) -> nn.Module:
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, process_group=dp_mesh.get_group())


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    sharding: ShardingConfig,
    train: TrainConfig,
    precision: PrecisionConfig,
    device: torch.device,
) -> nn.Module:
    """Apply the parallelisms in the fixed order above to a meta-device model; returns it materialized.

    Which data-parallel wrapper and which precision path is core.wrapping's decision, shared with the plan.
    """
    check_supported(sharding, precision)
    wrap = wrapping_of(sharding, precision)
    # pipeline split: done before, by pipeline.build_pipeline (each stage's part comes here).
    apply_float8(model, precision, wrap.fsdp)
    if sharding.tp > 1:
        # float8 activations in TP collectives: tensorwise recipe only, and NCCL (gloo has no float8 dtypes).
        float8_collectives = precision.fp8 and precision.fp8_recipe == "tensorwise" and device.type == "cuda"
        apply_tp(model, mesh["tp"], float8_tensorwise=float8_collectives)
    if sharding.ep > 1:
        # every GroupedExperts: E/ep experts here, all-to-all around them; gradients / ep for FSDP2's mean
        # under tp the experts stay replicated over it: 2-D (ep, tp) weights (expert.py's docstring)
        tp_mesh = mesh["ep", "tp"] if sharding.tp > 1 else None
        apply_expert_parallel(model, mesh["ep"], grad_divisor=sharding.ep, tp_mesh=tp_mesh)
    if sharding.cp > 1:
        expand_kv_heads_for_cp(model)  # the ring's kernels take equal q and kv head counts
    apply_activation_checkpointing(model, train.activation_checkpointing, train.ac_every)
    if train.compile:
        if device.type == "cuda":
            check_compiler()
        apply_compile(model)
    dp_mesh = dp_mesh_for(wrap.dp_mesh, mesh) if wrap.dp_mesh else None
    if wrap.fsdp:
        quantize_before_sharding(model)
        if sharding.ep > 1:  # the experts first: their own units over the ranks that hold the same experts
            shard_experts(model, expert_dp_mesh(mesh, wrap.dp_mesh), wrap.reshard_after_forward, fsdp_mp_policy(wrap))
        apply_fsdp(model, dp_mesh, wrap.reshard_after_forward, fsdp_mp_policy(wrap), sharding.cpu_offload)
    elif wrap.fsdp_as_ddp:
        # DDP's reducer cannot bucket DTensors, and breaks when a schedule runs several forwards before a backward.
        apply_replicate_over_tp(model, dp_mesh)
    materialize(model, device, sharding.cpu_offload)
    # zero1 is DDP for the gradients; its optimizer (optim.py) shards the AdamW states.
    if wrap.ddp:
        model = apply_ddp(model, dp_mesh, device)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The Llama module under a DDP wrapper (FSDP2 modifies the module in place)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def gradient_sync(model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
    """Context for one backward: reduce gradients across dp ranks only when `enabled` (last micro-batch)."""
    if isinstance(model, DistributedDataParallel):
        return contextlib.nullcontext() if enabled else model.no_sync()
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()
