"""Muon for the hidden matrices with AdamW for the rest, as one optimizer (torch.optim.Muon's update, torch >= 2.9).

Muon orthogonalizes each hidden matrix's momentum by Newton-Schulz; the embedding, the output head, norms, biases and
the MoE families' stacked expert weights ([E, a, b]: torch's Muon takes 2-D matrices only) keep AdamW
(core/optimizers.muon_steps says which, by name and shape, for the plan and here alike). One optim.lr serves both
when optim.muon_adjust_lr=match_rms_adamw: torch scales Muon's lr per A x B matrix by 0.2 x sqrt(max(A, B)) so its
update has AdamW's RMS (Moonshot, "Muon is Scalable for LLM Training"); `original` scales by sqrt(max(1, A/B))
(Keller Jordan's).

Sharded matrices (FSDP2's dim-0 shards, tensor parallelism, both): Newton-Schulz needs the whole matrix, so
GatheredMuon keeps the momentum on the shard (an elementwise update), all-gathers the (nesterov) update of one
matrix at a time, orthogonalizes it whole on every rank (the same input, the same result), keeps its own shard of
the result and steps the shard. What it costs: per matrix an all-gather of the fp32 update (the matrix's bytes over
the network) and Newton-Schulz's flops on every rank instead of one; memory: the whole matrix's fp32 update and
bf16 iterates at once, the largest matrix's counted in the plan's step peak (core/optimizers.py).

The two torch optimizers share this one's param group dicts and state, so set_lr, clipping, state_dict and DCP
see one optimizer; load_state_dict rebinds them after torch replaces both.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from trainctl.train.optim_closure import closure_loss


class GatheredMuon(torch.optim.Muon):
    """torch.optim.Muon's single-tensor update (the same ops on a plain tensor), with a sharded matrix gathered
    for Newton-Schulz (module doc)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        buf, grad, momentum = state["momentum_buffer"], p.grad, group["momentum"]
        buf.lerp_(grad, 1 - momentum)
        update = grad.lerp(buf, momentum) if group["nesterov"] else buf
        whole = update.full_tensor() if isinstance(update, DTensor) else update
        del update  # the shard's copy is not needed once gathered
        ortho = _zeropower_via_newtonschulz(whole, group["ns_coefficients"], group["ns_steps"], group["eps"])
        del whole
        if isinstance(p, DTensor):  # every rank holds the whole result: keep this rank's shard, no communication
            ortho = distribute_tensor(ortho, p.device_mesh, p.placements, src_data_rank=None)
        lr = group["lr"]
        p.mul_(1 - lr * group["weight_decay"])
        p.add_(ortho, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))


class MuonWithAdamW(torch.optim.Optimizer):
    def __init__(self, params, *, lr: float, weight_decay: float, momentum: float, nesterov: bool,
                 adjust_lr_fn: str, betas: tuple[float, float], eps: float, foreach: bool = False,
                 fused: bool = False):
        groups = list(params)  # dicts, each with "muon" (trainctl/train/optim.py's param_groups)
        muon, rest = [g for g in groups if g["muon"]], [g for g in groups if not g["muon"]]
        # torch refuses an optimizer without parameters: LoRA may leave AdamW nothing.
        self.parts = ([GatheredMuon(muon, lr=lr, weight_decay=weight_decay, momentum=momentum,
                                    nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)] if muon else []) + \
            ([torch.optim.AdamW(rest, lr=lr, betas=betas, eps=eps, foreach=foreach, fused=fused)] if rest else [])
        super().__init__([g for part in self.parts for g in part.param_groups], {})
        self._bind()

    def _bind(self) -> None:
        start = 0
        for part in self.parts:
            count = len(part.param_groups)
            part.param_groups, part.state = self.param_groups[start:start + count], self.state
            start += count

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        for part in self.parts:
            part.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._bind()
