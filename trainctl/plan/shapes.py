"""The parameter tensors one rank holds, tensor by tensor, without torch.

The memory plan counts bytes per tensor rather than per parameter, because that is how the
worker's libraries split them:
- tensor parallelism (trainctl/train/tensor_parallel.py) splits wq/wk/wv/w1/w3 and the output
  projection by rows (column-parallel), wo/w2 by columns (row-parallel), the embedding by
  vocabulary rows, and replicates the RMSNorm weights on every tp rank;
- FSDP2 `fully_shard` splits every (tp-local) tensor on dim 0 into dp_shard chunks of
  ceil(rows / dp_shard) rows, so rank 0 holds the largest chunk;
- ZeroRedundancyOptimizer (zero1) gives whole tensors to ranks, largest first, each to the rank
  with the fewest elements so far (torch's `_partition_parameters`).
`stage_tensors` lists the tensors in `model.parameters()` order of the stage the worker builds
(pipeline.build_stage_model): the first stage holds the embedding, the last the final norm and
output projection, a tied output is the embedding (counted once).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainctl.config.schema import ModelConfig, head_dim_of

# Split by output rows (ColwiseParallel), by input columns (RowwiseParallel); the rest is replicated.
_COLWISE = ("wq", "wk", "wv", "w1", "w3", "output", "tok_embeddings")
_ROWWISE = ("wo", "w2")


@dataclass(frozen=True)
class Tensor:
    name: str  # as in model.named_parameters(), e.g. layers.3.attention.wq.weight
    rows: int
    cols: int  # 1 for vectors (the norm weights)

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def is_matmul(self) -> bool:
        """Used in a matmul (autocast casts it, float8 may convert it): not a norm, not the embedding lookup."""
        return self.cols > 1 and not self.name.startswith("tok_embeddings")


def block_tensors(m: ModelConfig, index: int) -> list[Tensor]:
    """One transformer block's weights in registration order (norm, attention, norm, feed-forward)."""
    head_dim = head_dim_of(m)
    q, kv = m.n_heads * head_dim, m.n_kv_heads * head_dim
    p = f"layers.{index}."
    attention = []
    for name, rows in (("wq", q), ("wk", kv), ("wv", kv)):
        attention.append(Tensor(p + f"attention.{name}.weight", rows, m.dim))
        attention += [Tensor(p + f"attention.{name}.bias", rows, 1)] if m.qkv_bias else []
    attention.append(Tensor(p + "attention.wo.weight", m.dim, q))
    if m.qk_norm:
        attention += [Tensor(p + f"attention.{name}.weight", head_dim, 1) for name in ("q_norm", "k_norm")]
    return [
        Tensor(p + "attention_norm.weight", m.dim, 1),
        *attention,
        Tensor(p + "ffn_norm.weight", m.dim, 1),
        Tensor(p + "feed_forward.w1.weight", m.ffn_dim, m.dim),
        Tensor(p + "feed_forward.w2.weight", m.dim, m.ffn_dim),
        Tensor(p + "feed_forward.w3.weight", m.ffn_dim, m.dim),
    ]


def embedding_tensor(m: ModelConfig) -> Tensor:
    return Tensor("tok_embeddings.weight", m.vocab_size, m.dim)


def head_tensors(m: ModelConfig, first: bool) -> list[Tensor]:
    """The final norm and the output projection (none when tied to an embedding this stage holds)."""
    tensors = [Tensor("norm.weight", m.dim, 1)]
    if not (m.tie_embeddings and first):
        tensors.append(Tensor("output.weight", m.vocab_size, m.dim))
    return tensors


def stage_tensors(m: ModelConfig, layers: range, first: bool, last: bool) -> list[Tensor]:
    """Every parameter tensor of one stage (the whole model: all layers, first and last)."""
    tensors = [embedding_tensor(m)] if first else []
    for index in layers:
        tensors += block_tensors(m, index)
    return tensors + (head_tensors(m, first) if last else [])


def _kind(name: str) -> str:
    leaf = name.rsplit(".", 2)[-2]  # the module's own name: wq, w2, output, ...
    return "col" if leaf in _COLWISE else "row" if leaf in _ROWWISE else "replicated"


def tp_local(t: Tensor, tp: int) -> Tensor:
    """The tensor a tp rank holds (validate made tp divide heads, kv-heads, ffn_dim and dim)."""
    kind = _kind(t.name)
    if tp == 1 or kind == "replicated":
        return t
    if kind == "col":
        return Tensor(t.name, -(-t.rows // tp), t.cols)
    return Tensor(t.name, t.rows, -(-t.cols // tp))


def fsdp_rows(rows: int, shards: int, rank: int = 0) -> int:
    """Rows of dim 0 that FSDP2 gives `rank` of `shards` (torch.chunk: ceil-sized chunks, the last ones short)."""
    chunk = -(-rows // shards)
    return max(0, min(chunk, rows - rank * chunk))


def fsdp_local_numel(t: Tensor, shards: int, rank: int = 0) -> int:
    return fsdp_rows(t.rows, shards, rank) * t.cols


def zero1_partition(tensors: list[Tensor], ranks: int) -> list[tuple[int, int]]:
    """(elements, tensors) each rank's ZeroRedundancyOptimizer steps.

    Whole tensors, largest first, each to the emptiest rank.

    torch partitions each parameter group in turn with running totals shared across groups;
    the worker's two groups are the decayed matmul weights and the rest (norms, embedding).
    """
    sizes, counts = [0] * ranks, [0] * ranks
    decayed = [t for t in tensors if t.is_matmul]
    rest = [t for t in tensors if not t.is_matmul]
    for group in (decayed, rest):
        for t in sorted(group, key=lambda t: t.numel, reverse=True):
            rank = sizes.index(min(sizes))
            sizes[rank] += t.numel
            counts[rank] += 1
    return list(zip(sizes, counts, strict=True))
