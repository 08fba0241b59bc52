"""QLoRA's 4-bit base, torch-free: torchao's NF4 layout, its bytes, and what it refuses.

`model.lora.base_dtype=nf4` stores each adapted projection's frozen weight as torchao's NF4Tensor (the format
torchtune's QLoRA uses): 4-bit codes (two per byte), one int8 scale per BLOCK weights, one scale factor (in the
weight's dtype) per SCALER_BLOCK of those int8 scales, plus one mean and the 16-entry code table per tensor.
torchao's `to_nf4` needs the weight's element count divisible by BLOCK * SCALER_BLOCK (its double quantization
reshapes the scales into blocks of SCALER_BLOCK). The sizes are torchao's `to_nf4` defaults, which torchtune
uses too (a unit test reads them from torchao).
"""

from __future__ import annotations

BASE_DTYPES = ("fp32", "nf4")
BLOCK = 64  # weights per int8 scale
SCALER_BLOCK = 256  # int8 scales per scale factor
CODES = 16  # the NF4 code table, kept with every tensor
QUANTUM = BLOCK * SCALER_BLOCK  # a weight's element count must be a multiple of it


def enabled(lora) -> bool:
    return lora.rank > 0 and lora.base_dtype == "nf4"


def tensor_bytes(numel: int, dtype_bytes: int = 4) -> int:
    """Bytes of one NF4Tensor of `numel` weights quantized from a `dtype_bytes` tensor (its inner tensors)."""
    return numel // 2 + numel // BLOCK + dtype_bytes * (numel // QUANTUM + 1 + CODES)


def problems(lora) -> list[str]:
    """nf4 without adapters: nothing would train, and a 4-bit full fine-tune is not what QLoRA is."""
    if lora.base_dtype == "nf4" and lora.rank <= 0:
        return [f"model.lora.base_dtype=nf4: quantizes the frozen base under LoRA adapters, but model.lora.rank="
                f"{lora.rank}; set model.lora.rank (e.g. 8 or 16), or model.lora.base_dtype=fp32"]
    return []


def shape_problems(lora, shapes: dict[str, tuple[int, int]], targets: dict[str, str]) -> list[str]:
    """Adapted projections whose in x out torchao's block sizes do not divide.

    `shapes`: each matmul's (in, out) by its path in a block; `targets`: model.lora.targets' names -> paths."""
    if not enabled(lora):
        return []
    bad = {t: shapes[targets[t]] for t in lora.targets if t in targets
           and (shapes[targets[t]][0] * shapes[targets[t]][1]) % QUANTUM}
    if not bad:
        return []
    sizes = ", ".join(f"{t} {i}x{o}" for t, (i, o) in bad.items())
    return [f"model.lora.base_dtype=nf4: torchao's NF4 quantizes in blocks of {BLOCK} weights with one scale "
            f"factor per {SCALER_BLOCK} blocks, so each adapted weight needs in x out divisible by {QUANTUM}; "
            f"{sizes} is not; adapt other projections (model.lora.targets), or model.lora.base_dtype=fp32"]


def shard_problems(lora, shapes: dict[str, tuple[int, int]], targets: dict[str, str], shards: int) -> list[str]:
    """Under FSDP2 each rank holds `shards`-th of every 4-bit weight's rows, cut from the whole tensor's codes and
    scales (torchao's chunk of an NF4Tensor): whole scale-factor blocks each, so out divisible by `shards` and
    in x out by QUANTUM x `shards` (a 1/shards slice of a block has no scale factor of its own)."""
    if not enabled(lora) or shards <= 1:
        return []
    bad = {t: shapes[targets[t]] for t in lora.targets if t in targets
           and (shapes[targets[t]][1] % shards or (shapes[targets[t]][0] * shapes[targets[t]][1]) % (QUANTUM * shards))}
    if not bad:
        return []
    sizes = ", ".join(f"{t} {i}x{o}" for t, (i, o) in bad.items())
    return [f"model.lora.base_dtype=nf4 with sharding.dp_shard={shards}: FSDP2 gives each rank whole NF4 scale-factor "
            f"blocks of every adapted weight, so out must divide by {shards} and in x out by {QUANTUM} x {shards}; "
            f"{sizes} does not; adapt other projections (model.lora.targets), shard over fewer ranks "
            "(sharding.dp_shard, or sharding=hsdp), or sharding=ddp or zero1 (the 4-bit base replicated)"]


def layout_problems(lora, fsdp: bool, cpu_offload: bool) -> list[str]:
    """The layouts the worker quantizes the base under: DDP and zero1 (replicated), FSDP2 (zero2, zero3, hsdp:
    sharded by rows), but not FSDP2's CPU offload (the 4-bit shards' host copies are not implemented)."""
    if not enabled(lora) or not (fsdp and cpu_offload):
        return []
    return ["sharding.cpu_offload=true: offloading a 4-bit base (model.lora.base_dtype=nf4) is not implemented in "
            "the worker yet; use sharding.cpu_offload=false (FSDP2 shards the 4-bit base: zero2, zero3, fsdp or "
            "hsdp), sharding=ddp or zero1, or model.lora.base_dtype=fp32"]
