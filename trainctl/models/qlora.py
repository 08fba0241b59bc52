"""QLoRA: the adapted projections' frozen weights as torchao's 4-bit NF4Tensor (names, sizes: core/nf4.py).

`quantize_base` runs once the base weights hold their values (after init or checkpoint.init_from's load, before a
resume's checkpoint is read into them): each LoRALinear's `weight` becomes a frozen NF4 parameter under its own
name. Its forward is torchao's: `F.linear` on an NF4Tensor dequantizes the weight to the input's dtype, and the
backward passes the input gradient through that dequantized weight (the base itself gets none). Checkpoints keep
the NF4 tensor as torchao pickles it (DCP saves and reads it whole); readers outside training dequantize it
(`dequantized`).

torchao is optional (`pip install 'trainctl[fp8]'`), imported only when a run asks for nf4.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from trainctl.config.schema import LoRAConfig
from trainctl.core import checkpoints, model_record, rundir
from trainctl.core import nf4 as spec
from trainctl.core.errors import UserError
from trainctl.core.lora import quantized_base
from trainctl.models.common.quantized import is_nf4
from trainctl.models.lora import LoRALinear

INSTALL = "model.lora.base_dtype=nf4 needs torchao: pip install 'trainctl[fp8]'"


def torchao_nf4():
    """(NF4Tensor, to_nf4) from torchao: its 0.x home (torchao.quantization) or the older torchao.dtypes.nf4tensor."""
    try:
        from torchao.quantization import NF4Tensor, to_nf4
    except ImportError:
        try:
            from torchao.dtypes.nf4tensor import NF4Tensor, to_nf4
        except ImportError:
            raise UserError([INSTALL]) from None
    return NF4Tensor, to_nf4


def quantize(weight: torch.Tensor) -> torch.Tensor:
    """`weight` as an NF4Tensor with core/nf4.py's block sizes (quantized in the weight's own dtype)."""
    _, to_nf4 = torchao_nf4()
    return to_nf4(weight.detach().contiguous(), spec.BLOCK, spec.SCALER_BLOCK)


@torch.no_grad()
def quantize_base(model: nn.Module, lora) -> int:
    """Every LoRALinear's frozen weight as NF4, in place; returns how many (0 unless model.lora.base_dtype=nf4).

    On the meta device (FSDP2, before fully_shard) this makes NF4 tensors of the right layout and no values."""
    if not spec.enabled(lora):
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, LoRALinear) and not is_nf4(module.weight):
            module.weight = nn.Parameter(quantize(module.weight), requires_grad=False)
            count += 1
    return count


def dequantized(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor of an NF4Tensor's values (in the dtype it was quantized from); other tensors as they are."""
    return tensor.get_original_weight() if is_nf4(tensor) else tensor


def placeholder(shape, dtype: torch.dtype) -> torch.Tensor:
    """An NF4Tensor of `shape` for DCP to read a saved one into (its metadata must match the saved tensor's)."""
    return quantize(torch.ones(shape, dtype=dtype))


def saved_nf4(ckpt: Path) -> LoRAConfig | None:
    """The LoRA of a checkpoint whose model record says model.lora.base_dtype=nf4 (its base saved as NF4), else
    None."""
    saved = (rundir.read_json(ckpt / checkpoints.META) or {}).get(model_record.KEY)
    lora = saved.get("lora") if isinstance(saved, dict) else None
    if not isinstance(lora, dict) or lora.get("base_dtype") != "nf4":
        return None
    return LoRAConfig(rank=int(lora.get("rank", 0)), targets=list(lora.get("targets", [])), base_dtype="nf4")


def saved_nf4_names(ckpt: Path, names: list[str]) -> set[str]:
    """Which of `names` a checkpoint saved as NF4 tensors."""
    lora = saved_nf4(ckpt)
    return {n for n in names if quantized_base(n, lora)} if lora else set()


def base_bytes(model: nn.Module) -> int:
    """Bytes of the NF4 weights this process holds (their inner tensors), what core/nf4.py's formula counts."""
    total = 0
    for param in model.parameters():
        if is_nf4(param):
            local = getattr(param, "_local_tensor", param)  # FSDP2: this rank's rows
            names, _ = local.__tensor_flatten__()
            total += sum(getattr(local, n).numel() * getattr(local, n).element_size() for n in names)
    return total
