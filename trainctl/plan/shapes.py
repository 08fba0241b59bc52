"""The parameter tensors one rank holds, tensor by tensor, without torch.

The tensors are the family's (models/<family>/spec.py). The memory plan counts bytes per tensor rather than
per parameter, because that is how the worker's libraries split them:
- tensor parallelism (the family's parallel.py, applied by trainctl/train/parallel/tensor_parallel.py) splits
  wq/wk/wv/w1/w3 (and q/k/v biases) and the output projection by rows (column-parallel), wo/w2 by
  columns (row-parallel), the embedding by vocabulary rows, and replicates the norm weights on every rank;
- FSDP2 `fully_shard` splits every (tp-local) tensor on dim 0 into dp_shard chunks of
  ceil(rows / dp_shard) rows, so rank 0 holds the largest chunk;
- ZeroRedundancyOptimizer (zero1) gives whole tensors to ranks, largest first, each to the rank
  with the fewest elements so far (torch's `_partition_parameters`).
`stage_tensors` lists the tensors in `model.parameters()` order of the stage the worker builds
(pipeline.build_stage_model): the first stage holds the embedding, the last the final norm and
output projection, a tied output is the embedding (counted once).
"""

from __future__ import annotations

from trainctl.config.schema import ModelConfig
from trainctl.core.lora import adapter_tensors
from trainctl.core.tensors import Tensor
from trainctl.models.registry import spec

__all__ = ["Tensor", "block_tensors", "embedding_tensor", "fsdp_local_numel", "fsdp_rows", "head_tensors",
           "stage_tensors", "tp_local", "zero1_assignment", "zero1_partition"]



def block_tensors(m: ModelConfig, index: int) -> list[Tensor]:
    """One transformer block's weights in registration order (the family's spec), then model.lora's adapters."""
    block = spec(m.family).block_tensors(m, index)
    return block + adapter_tensors(block, m.lora)


def embedding_tensor(m: ModelConfig) -> Tensor:
    return spec(m.family).embedding_tensor(m)


def head_tensors(m: ModelConfig, first: bool) -> list[Tensor]:
    """The final norm and the output projection (none when tied to an embedding this stage holds)."""
    return spec(m.family).head_tensors(m, first)


def stage_tensors(m: ModelConfig, layers: range, first: bool, last: bool) -> list[Tensor]:
    """Every parameter tensor of one stage (the whole model: all layers, first and last)."""
    tensors = [embedding_tensor(m)] if first else []
    for index in layers:
        tensors += block_tensors(m, index)
    return tensors + (head_tensors(m, first) if last else [])


def _kind(name: str, family: str = "llama") -> str:
    leaf = name.rsplit(".", 2)[-2]  # the module's own name: wq, w2, output, ...
    fam = spec(family)
    return "col" if leaf in fam.tp_colwise else "row" if leaf in fam.tp_rowwise else "replicated"


def tp_local(t: Tensor, tp: int, family: str = "llama") -> Tensor:
    """The tensor a tp rank holds (validate made tp divide heads, kv-heads, ffn_dim and dim)."""
    kind = _kind(t.name, family)
    if tp == 1 or kind == "replicated":
        return t
    if kind == "col":
        return Tensor(t.name, -(-t.rows // tp), t.cols)
    if t.cols == 1:  # a row-parallel layer's bias is not split
        return t
    return Tensor(t.name, t.rows, -(-t.cols // tp))


def fsdp_rows(rows: int, shards: int, rank: int = 0) -> int:
    """Rows of dim 0 that FSDP2 gives `rank` of `shards` (torch.chunk: ceil-sized chunks, the last ones short)."""
    chunk = -(-rows // shards)
    return max(0, min(chunk, rows - rank * chunk))


def fsdp_local_numel(t: Tensor, shards: int, rank: int = 0) -> int:
    return fsdp_rows(t.rows, shards, rank) * t.cols


def zero1_assignment(tensors: list[Tensor], ranks: int) -> list[list[Tensor]]:
    """The tensors each rank's ZeroRedundancyOptimizer steps.

    Whole tensors, largest first, each to the emptiest rank.

    torch partitions each parameter group in turn with running totals shared across groups;
    the worker's two groups are the decayed matmul weights and the rest (norms, embedding).
    """
    sizes, owned = [0] * ranks, [[] for _ in range(ranks)]
    decayed = [t for t in tensors if t.is_matmul]
    rest = [t for t in tensors if not t.is_matmul]
    for group in (decayed, rest):
        for t in sorted(group, key=lambda t: t.numel, reverse=True):
            rank = sizes.index(min(sizes))
            sizes[rank] += t.numel
            owned[rank].append(t)
    return owned


def zero1_partition(tensors: list[Tensor], ranks: int) -> list[tuple[int, int]]:
    """(elements, tensors) each rank's ZeroRedundancyOptimizer steps (`zero1_assignment`)."""
    return [(sum(t.numel for t in mine), len(mine)) for mine in zero1_assignment(tensors, ranks)]
