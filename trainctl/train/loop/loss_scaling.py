"""Dynamic loss scaling for fp16: scale the loss in backward, unscale before clipping, skip on overflow.

fp16's narrow range underflows small gradients; multiplying the loss by a large scale
keeps them representable. After backward the gradients are unscaled (in place, so
grad-norm clipping sees true values); if any is inf/nan the optimizer step is skipped
(weights and optimizer state unchanged; the LR is a pure function of the step, so
nothing else moves) and the scale is halved; after `growth_interval` clean steps it doubles.

Every rank must agree to skip: in a multi-rank world we use torch's ShardedGradScaler,
which all-reduces the found-inf flag over all ranks (it works with FSDP2's DTensor
gradients and with plain ones: pipeline or tensor-parallel ranks hold different
gradients, so DDP's identical gradients are not enough in general). A single process
uses torch.amp.GradScaler.

Skips are detected from the scale itself: it only ever decreases on an overflow.
GradScaler.step already reads its found-inf flag on the host every step, so reading the
scale back costs no extra pipeline stall worth avoiding.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.amp import GradScaler
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from trainctl.config.schema import PrecisionConfig


class NoLossScaling:
    """bf16/fp32: backward the loss as is and always step."""

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def metrics(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class DynamicLossScaler:
    """A torch GradScaler plus the bookkeeping the loop logs: current scale, skipped steps."""

    def __init__(self, scaler: GradScaler, init_scale: float, device: torch.device | None = None):
        self.scaler = scaler
        if device is not None:
            # GradScaler creates its scale tensor on the first scale(); a pipeline stage without the
            # loss never calls it, yet unscales and steps like every rank. Create it now.
            scaler.scale(torch.ones((), device=device))
        self.loss_scale = init_scale
        self.skipped_steps = 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on (one micro-batch)."""
        return self.scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide gradients by the scale in place (before clipping) and record whether any overflowed."""
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step unless a gradient overflowed on any rank; then adjust the scale."""
        self.scaler.step(optimizer)
        self.scaler.update()
        scale = self.scaler.get_scale()
        self.skipped_steps += scale < self.loss_scale
        self.loss_scale = scale

    def metrics(self) -> dict:
        return {"loss_scale": self.loss_scale, "skipped_steps": self.skipped_steps}

    def state_dict(self) -> dict:
        """What a checkpoint must carry to resume with the same scale."""
        return {"scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = state["skipped_steps"]
        self.loss_scale = self.scaler.get_scale()


def build_loss_scaler(precision: PrecisionConfig, device: torch.device) -> NoLossScaling | DynamicLossScaler:
    """Dynamic loss scaling when `precision.loss_scaling` (validate requires it for fp16), else a no-op."""
    if not precision.loss_scaling:
        return NoLossScaling()
    if dist.is_initialized() and dist.get_world_size() > 1:
        scaler = ShardedGradScaler(device=device.type, init_scale=precision.init_scale, process_group=dist.group.WORLD)
    else:
        scaler = GradScaler(device.type, init_scale=precision.init_scale)
    return DynamicLossScaler(scaler, precision.init_scale, device)
