"""A mixture of experts' share of one optimizer step: the auxiliary loss each micro-batch adds to its language-model
loss, the expert load per layer that metrics.jsonl records, and the aux-loss-free bias update.

The MoE blocks (models/common/moe.py) keep the auxiliary loss and the load of their last forward; `take` reads
them after each micro-batch's forward. Each micro-batch's auxiliary loss is a mean over its tokens, so it is
weighted 1/micro-batches: the step's is the mean over its micro-batches whatever the accumulation, and DDP / FSDP's
gradient average over the data-parallel ranks makes it the mean over ranks, as the token loss's normalisation does.
Under tensor parallelism each tp rank routes its own part of every sequence: its auxiliary loss is its part of the
micro-batch's, and its counts its own tokens', so the sums over every rank count each token once.
Under pipeline parallelism each pp rank holds some layers: its auxiliary loss is theirs (the pp ranks' add up to the
model's) and its load fills their rows of the [layers, experts] table (train/parallel/stage_aux.py takes each
stage's after its forward), so the one all-reduce over every rank completes both.
A dense model has no MoE block: every method is then a no-op and no collective runs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainctl.models.common.moe import MoE


class ExpertLoad:
    def __init__(self, blocks: list[tuple[str, MoE]], stage_group: dist.ProcessGroup | None = None):
        self.blocks = blocks  # models.common.moe.moe_blocks of the model (Job.expert_blocks)
        self.stage_group = stage_group  # the pp group (None: no pipeline): its ranks hold the other layers
        # Each block's row in the model's [layers, experts] table: its global layer key (kept by a pipeline split).
        self.rows = {id(block): _row(key, index) for index, (key, block) in enumerate(blocks)}
        # The rows of each block list `add` has seen, as a device tensor made once: a host list copied to the GPU at
        # every micro-batch would wait for the stream's queued kernels each time.
        self._indices: dict[tuple[int, ...], torch.Tensor] = {}
        self.aux = None  # the step's auxiliary loss so far (detached)
        self.counts = None  # [layers, experts] tokens routed this step (this rank; zeros in layers it does not hold)
        self.dropped = None  # [layers] tokens dropped by the capacity this step (this rank)

    def take(self, micro_batches: int, blocks: list[tuple[str, MoE]] | None = None) -> torch.Tensor | None:
        """After one micro-batch's forward of `blocks` (default: every block): the auxiliary loss to add to its loss
        (None: none), its load noted."""
        aux, record = self.read(micro_batches, blocks)
        if record is not None:
            self.add(record)
        return aux

    def read(self, micro_batches: int, blocks: list[tuple[str, MoE]] | None = None):
        """(the auxiliary loss of one forward of `blocks`, weighted, with its graph; its load as a record for `add`),
        without counting it yet: a pipeline stage keeps only its real micro-batches' (train/parallel/stage_aux.py).
        (None, None) without blocks."""
        blocks = self.blocks if blocks is None else blocks
        if not blocks:
            return None, None
        losses = [block.aux_loss for _, block in blocks if block.aux_loss is not None]
        for _, block in blocks:
            block.aux_loss = None  # the graph is the caller's now
        aux = torch.stack(losses).sum() / micro_batches if losses else None
        counts = torch.stack([block.load["counts"] for _, block in blocks])
        dropped = torch.stack([block.load["dropped"] for _, block in blocks])
        rows = [self.rows[id(block)] for _, block in blocks]
        return aux, (rows, counts, dropped, None if aux is None else aux.detach())

    def add(self, record) -> None:
        """Count one forward's load and auxiliary loss (a record of `read`) into the step's."""
        rows, counts, dropped, aux = record
        if self.counts is None:
            layers, experts = self.blocks[0][1].n_layers, self.blocks[0][1].moe.num_experts
            self.counts, self.dropped = counts.new_zeros(layers, experts), dropped.new_zeros(layers)
        index = self._indices.get(tuple(rows))
        if index is None:
            index = self._indices[tuple(rows)] = torch.tensor(rows, device=self.counts.device)
        self.counts.index_add_(0, index, counts.to(self.counts))
        self.dropped.index_add_(0, index, dropped.to(self.dropped))
        if aux is not None:
            self.aux = aux if self.aux is None else self.aux + aux

    def finish(self) -> dict:
        """After the optimizer step: the step's load over every rank, the aux-loss-free bias update, and the
        metrics (one all-reduce; {} for a dense model or a step without a forward)."""
        if self.counts is None:
            return {}
        aux = self.aux if self.aux is not None else torch.zeros((), device=self.counts.device)
        packed = torch.cat([self.counts.double().flatten(), self.dropped.double(), aux.double().reshape(1)])
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world > 1:
            dist.all_reduce(packed)
        layers, experts = self.counts.shape
        counts = packed[:layers * experts].reshape(layers, experts)
        for _, block in self.blocks:
            block.update_bias(counts[self.rows[id(block)]])
        mean = counts.mean(dim=1).clamp(min=1e-12)
        metrics = {"expert_load": counts.long().tolist(),
                   "expert_imbalance": [round(v, 4) for v in (counts.max(dim=1).values / mean).tolist()],
                   "expert_dropped": packed[layers * experts:-1].long().tolist()}
        if self.aux is not None:
            metrics["aux_loss"] = packed[-1].item() / (world // (self.token_shards() * self.stages()))
        return metrics

    def token_shards(self) -> int:
        """How many ranks share each sequence's routing (tp): each holds a part of the auxiliary loss (moe.py)."""
        group = self.blocks[0][1].token_group
        return 1 if group is None else dist.get_world_size(group)

    def stages(self) -> int:
        """How many ranks share each micro-batch's layers (pp): each holds its layers' part of the auxiliary loss."""
        return 1 if self.stage_group is None else dist.get_world_size(self.stage_group)


def _row(key: str, index: int) -> int:
    """A block's layer row: its key in the decoder's `layers` (global, a pipeline stage keeps it), else its order."""
    return int(key) if key.isdigit() else index
