"""A mixture of experts' auxiliary loss through pipeline stages.

torch.distributed.pipelining backpropagates only the last stage's loss (its loss_fn sees the last stage's output),
yet every stage's MoE blocks add a load-balancing loss (models/common/moe.py). After each forward of a stage, a
forward hook takes that stage's blocks' auxiliary loss and load (loop/expert_load.py: weighted 1/micro-batches, as
the one-process step weighs it) and returns the stage's output through `WithAuxLoss`: the identity in forward; in
backward it passes the output's gradient on and also backpropagates the auxiliary loss, scaled as the schedule
scales the token loss (the fp16 loss scale). Each stage's router thus gets what `(loss + aux).backward()` gives it
in one process, whichever schedule orders the backward passes. The load and the reported auxiliary loss count each
stage's real micro-batches only (`end`). Outside a training step (evaluation) no ExpertLoad is set and the hook leaves
the output alone.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from trainctl.models.common.moe import MoE, moe_blocks
from trainctl.train.loop.expert_load import ExpertLoad


class WithAuxLoss(torch.autograd.Function):
    """(output, aux) -> output; backward: the output's gradient, and 1 for `aux` (its own backward follows)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_dtype = aux.dtype
        # The same storage without copying, and not a view: the zero-bubble schedules detach stage outputs in place,
        # which a view refuses.
        return output.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones((), dtype=ctx.aux_dtype, device=grad.device)


class StageAux:
    """Hooks this rank's stage parts; the step brackets each schedule step with `begin` and `end`."""

    def __init__(self, parts: list[nn.Module], scale_loss: Callable[[torch.Tensor], torch.Tensor]):
        self.scale_loss = scale_loss
        self.load: ExpertLoad | None = None
        self.micro_batches = 1
        self.records: dict[int, list] = {}  # per stage part: each forward's load record (ExpertLoad.read), in order
        for part in parts:
            blocks = moe_blocks(part)
            if blocks:
                part.register_forward_hook(partial(self._after_forward, blocks))

    def begin(self, load: ExpertLoad | None, micro_batches: int) -> None:
        self.load, self.micro_batches, self.records = load, micro_batches, {}

    def end(self) -> None:
        """Count each stage's last `micro_batches` forwards: a schedule's first step also runs a forward of every
        stage to infer its shapes (torch.distributed.pipelining), whose output is dropped (as StageLoss drops its
        loss) and whose load must not count."""
        load, self.load = self.load, None
        for records in self.records.values():
            for record in records[max(0, len(records) - self.micro_batches):]:
                load.add(record)
        self.records = {}

    def _after_forward(self, blocks: list[tuple[str, MoE]], module: nn.Module, args, output):
        if self.load is None:
            for _, block in blocks:
                block.aux_loss = None  # evaluation or set-up: nothing to backpropagate
            return None
        aux, record = self.load.read(self.micro_batches, blocks)
        self.records.setdefault(id(module), []).append(record)
        if aux is None or not torch.is_grad_enabled():
            return None
        return WithAuxLoss.apply(output, self.scale_loss(aux))
