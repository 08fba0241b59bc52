"""The output projection and the cross-entropy, in chunks of tokens: no fp32 [tokens, vocab] tensor ever whole.

Computed densely, the loss of a micro-batch holds the logits, their fp32 copy, log-softmax's fp32 output,
and in backward two more fp32 [tokens, vocab] gradients: for Llama 3's 128k vocabulary at 8 x 2048 tokens,
about 8 GB each. `LinearCrossEntropy` instead walks the tokens in chunks and, for each chunk, computes its
logits (in the compute dtype, as the Linear would), the fp32 log-sum-exp and summed loss, and at once the
gradient of the loss with respect to those logits, hence the chunk's input gradient and its share of the
weight gradient. Backward then only scales the two saved gradients by the incoming one: the projection is
not recomputed (a checkpoint-per-chunk variant would recompute 2 * dim * vocab FLOPs per token, about 7%
of a 1B-parameter step). What stays alive until backward: the input gradient [tokens, dim] and the weight
gradient [vocab, dim], in the compute dtype.

`OutputHead` is the model's output Linear (same parameter, same checkpoint key) whose forward also takes
the targets and then returns the summed loss: called as a module, so FSDP2 gathers its weight around it.
Where the weight is a tensor-parallel DTensor or the Linear was swapped (float8), the model keeps the
dense loss (`dense_loss_sum`); so does a pipeline's last stage, whose schedule computes the loss
(core/loss_head.py states the rule the plan shares).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainctl.core import loss_head as rule

IGNORE_INDEX = -100  # F.cross_entropy's default: such targets add nothing to the loss or the gradients
CHUNK_BYTES = rule.CHUNK_BYTES  # one chunk's fp32 logits at most (the plan counts the same)


def chunk_tokens(vocab_size: int, chunk_bytes: int | None = None) -> int:
    """Tokens per chunk (core/loss_head.py's rule) under this module's CHUNK_BYTES, which tests may lower."""
    return rule.chunk_tokens(vocab_size, chunk_bytes or CHUNK_BYTES)


def dense_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy of whole logits, the softmax in fp32 whatever the compute dtype."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), reduction="sum",
                           ignore_index=IGNORE_INDEX)


def _chunk(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, with_grads: bool):
    """(summed loss, d loss / d logits in the compute dtype or None) of one chunk of tokens."""
    logits = (hidden @ weight.t()).float()
    lse = torch.logsumexp(logits, dim=-1)
    valid = targets != IGNORE_INDEX
    safe = torch.where(valid, targets, 0)
    picked = logits.gather(1, safe[:, None]).squeeze(1)
    loss = ((lse - picked) * valid).sum()
    if not with_grads:
        return loss, None
    # d/dlogits of (lse - picked): softmax minus the one-hot target; ignored tokens get zero rows.
    grad = logits.sub_(lse[:, None]).exp_()
    grad.scatter_add_(1, safe[:, None], -torch.ones_like(lse)[:, None])
    grad.mul_(valid[:, None])
    return loss, grad.to(hidden.dtype)


class LinearCrossEntropy(torch.autograd.Function):
    """sum over tokens of cross_entropy(hidden @ weight.T, targets), chunked; gradients computed in forward."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int):
        with_grads = any(ctx.needs_input_grad[:2])
        total = torch.zeros((), device=hidden.device, dtype=torch.float32)
        grad_hidden = torch.empty_like(hidden) if with_grads else None
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if with_grads else None
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            loss, grad = _chunk(hidden[rows], weight, targets[rows], with_grads)
            total += loss
            if with_grads:
                grad_hidden[rows] = grad @ weight
                grad_weight += (grad.t() @ hidden[rows]).float()
        if with_grads:
            ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = grad_total.to(grad_hidden.dtype)
        return grad_hidden * scale, grad_weight * scale.to(grad_weight.dtype), None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk: int | None = None) -> torch.Tensor:
    """Summed cross-entropy of hidden [..., dim] @ weight[vocab, dim].T against targets [...], fp32.

    Under torch.autocast the projection runs in the autocast dtype, as nn.Linear's would; the casts
    sit outside the Function, so their gradients flow back to fp32 weights as usual.
    """
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    elif hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)
    chunk = chunk or chunk_tokens(weight.shape[0])
    with torch.autocast(device_type, enabled=False):
        return LinearCrossEntropy.apply(hidden.flatten(0, -2), weight, targets.flatten(), chunk)


class OutputHead(nn.Linear):
    """The output projection; `forward(h, targets)` returns the summed loss without whole logits.

    `chunked`: False where the fused loss does not apply (tensor parallel shards the vocabulary); the
    model then computes the dense loss from this Linear's logits.
    """

    chunked = True

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return super().forward(hidden)
        return linear_cross_entropy(hidden, self.weight, targets)
