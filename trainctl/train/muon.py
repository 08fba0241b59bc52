"""Muon for the hidden matrices with AdamW for the rest, as one optimizer (torch.optim.Muon, torch >= 2.9).

Muon orthogonalizes each hidden matrix's momentum by Newton-Schulz; the embedding, the output head, norms and
biases keep AdamW (core/optimizers.muon_steps says which, by name and shape, for the plan and here alike). One
optim.lr serves both when optim.muon_adjust_lr=match_rms_adamw: torch scales Muon's lr per A x B matrix by
0.2 x sqrt(max(A, B)) so its update has AdamW's RMS (Moonshot, "Muon is Scalable for LLM Training");
`original` scales by sqrt(max(1, A/B)) (Keller Jordan's).

The two torch optimizers share this one's param group dicts and state, so set_lr, clipping, state_dict and DCP
see one optimizer; load_state_dict rebinds them after torch replaces both.
"""

from __future__ import annotations

import torch


class MuonWithAdamW(torch.optim.Optimizer):
    def __init__(self, params, *, lr: float, weight_decay: float, momentum: float, nesterov: bool,
                 adjust_lr_fn: str, betas: tuple[float, float], eps: float, foreach: bool = False,
                 fused: bool = False):
        groups = list(params)  # dicts, each with "muon" (trainctl/train/optim.py's param_groups)
        muon, rest = [g for g in groups if g["muon"]], [g for g in groups if not g["muon"]]
        # torch refuses an optimizer without parameters: LoRA may leave AdamW nothing.
        self.parts = ([torch.optim.Muon(muon, lr=lr, weight_decay=weight_decay, momentum=momentum,
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
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self.parts:
            part.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._bind()
