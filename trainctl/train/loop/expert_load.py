"""A mixture of experts' share of one optimizer step: the auxiliary loss each micro-batch adds to its language-model
loss, the expert load per layer that metrics.jsonl records, and the aux-loss-free bias update.

The MoE blocks (models/common/moe.py) keep the auxiliary loss and the load of their last forward; `take` reads
them after each micro-batch's forward. Each micro-batch's auxiliary loss is a mean over its tokens, so it is
weighted 1/micro-batches: the step's is the mean over its micro-batches whatever the accumulation, and DDP / FSDP's
gradient average over the data-parallel ranks makes it the mean over ranks, as the token loss's normalisation does.
Under tensor parallelism each tp rank routes its own part of every sequence: its auxiliary loss is its part of the
micro-batch's, and its counts its own tokens', so the sums over every rank count each token once.
A dense model has no MoE block: every method is then a no-op and no collective runs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainctl.models.common.moe import MoE


class ExpertLoad:
    def __init__(self, blocks: list[tuple[str, MoE]]):
        self.blocks = blocks  # models.common.moe.moe_blocks of the model (Job.expert_blocks)
        self.aux = None  # the step's auxiliary loss so far (detached)
        self.counts = None  # [layers, experts] tokens routed this step (this rank)
        self.dropped = None  # [layers] tokens dropped by the capacity this step (this rank)

    def take(self, micro_batches: int) -> torch.Tensor | None:
        """After one micro-batch's forward: the auxiliary loss to add to its loss (None: none), its load noted."""
        if not self.blocks:
            return None
        counts = torch.stack([block.load["counts"] for _, block in self.blocks])
        dropped = torch.stack([block.load["dropped"] for _, block in self.blocks])
        self.counts = counts if self.counts is None else self.counts + counts
        self.dropped = dropped if self.dropped is None else self.dropped + dropped
        losses = [block.aux_loss for _, block in self.blocks if block.aux_loss is not None]
        for _, block in self.blocks:
            block.aux_loss = None  # the graph is the caller's now
        if not losses:
            return None
        aux = torch.stack(losses).sum() / micro_batches
        self.aux = aux.detach() if self.aux is None else self.aux + aux.detach()
        return aux

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
        for (_, block), layer_counts in zip(self.blocks, counts, strict=True):
            block.update_bias(layer_counts)
        mean = counts.mean(dim=1).clamp(min=1e-12)
        metrics = {"expert_load": counts.long().tolist(),
                   "expert_imbalance": [round(v, 4) for v in (counts.max(dim=1).values / mean).tolist()],
                   "expert_dropped": packed[layers * experts:-1].long().tolist()}
        if self.aux is not None:
            metrics["aux_loss"] = packed[-1].item() / (world // self.token_shards())
        return metrics

    def token_shards(self) -> int:
        """How many ranks share each sequence's routing (tp): each holds a part of the auxiliary loss (moe.py)."""
        group = self.blocks[0][1].token_group
        return 1 if group is None else dist.get_world_size(group)
