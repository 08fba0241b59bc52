"""QLoRA's NF4 base under FSDP2: a whole NF4 tensor's rows as one rank's shard (torch only, no torchao import).

FSDP2 shards an NF4Tensor parameter through the ops torchao implements for it (chunk rows, new_zeros, copy_ of
the inner tensors; fsdp_pre/post_all_gather gather the 4-bit codes and scales). A shard of a whole-tensor
quantization keeps the whole tensor's scale mean, so the gathered weight equals the one-process quantization
bitwise; quantizing each shard alone would not.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard


def is_nf4(tensor) -> bool:
    """torchao's NF4Tensor, plain or as a DTensor's local shard (FSDP2)."""
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    return type(local).__name__ == "NF4Tensor"


def quantized_like(full: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`full` quantized whole with `local`'s NF4 block sizes (an NF4 `full` as it is)."""
    if is_nf4(full):
        return full
    return type(local).from_tensor(full.detach().contiguous(), local.block_size, local.scaler_block_size)


def own_rows(full: torch.Tensor, param: DTensor) -> torch.Tensor:
    """This rank's rows of the whole NF4 `full` under `param`'s placements (one Shard(0), the rest replicated),
    in fresh storage: the whole tensor is not kept alive by a view of it."""
    piece = full
    for dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard):
            piece = torch.chunk(piece, param.device_mesh.size(dim), dim=0)[param.device_mesh.get_local_rank(dim)]
    own = piece.new_zeros(piece.size())
    own.copy_(piece)
    return own


@torch.no_grad()
def set_whole(param: DTensor, full: torch.Tensor) -> None:
    """Put the whole weight `full` (fp32 or NF4) into the NF4-sharded `param`: quantized whole, this rank's rows.

    The local shard is replaced rather than copied into: a shard materialized from the meta device holds no
    scale mean or code table yet (torchao's empty_like makes only the sharded inner tensors). FSDP2 reads the
    new local tensor at its lazy init, as it does after load_state_dict(assign=True)."""
    param._local_tensor = own_rows(quantized_like(full, param._local_tensor), param)


def gathered(param: DTensor) -> torch.Tensor:
    """The whole NF4 weight of an FSDP2-sharded one, in plain storage: the gather's inner tensors come back as
    async collective results (torchao wraps each), which checkpoints cannot pickle; copying waits for them."""
    full = param.full_tensor()
    whole = full.new_zeros(full.size())
    whole.copy_(full)
    return whole
