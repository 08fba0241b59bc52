"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2), written once here.

The update is elementwise, so it steps a DTensor shard (FSDP2, tensor parallelism) as it steps a whole tensor:
    update = sign(beta1 * m + (1 - beta1) * g)
    p      = p * (1 - lr * weight_decay) - lr * update
    m      = beta2 * m + (1 - beta2) * g
One state tensor per parameter (the moment m, fp32 like the master weights) and no step counter: what
core/optimizers.py counts for the plan. One tensor at a time, so the step's only temporary is the largest update.
"""

from __future__ import annotations

import torch

from trainctl.train.optim_closure import closure_loss


class Lion(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, decay = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                exp_avg = state["exp_avg"]
                update = exp_avg.mul(beta1).add_(p.grad, alpha=1 - beta1).sign_()
                p.mul_(1 - lr * decay).add_(update, alpha=-lr)
                exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)
                del update  # else it lives on while the next tensor's is made: two temporaries at once, not one
        return loss
