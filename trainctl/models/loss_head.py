"""The output projection and the cross-entropy, in chunks of tokens: no fp32 [tokens, vocab] tensor ever whole.

Computed densely, the loss of a micro-batch holds the logits, their fp32 copy, log-softmax's fp32 output,
and in backward two more fp32 [tokens, vocab] gradients: for Llama 3's 128k vocabulary at 8 x 2048 tokens,
about 8 GB each. `LinearCrossEntropy` instead walks the tokens in chunks and, for each chunk, computes its
logits (in the compute dtype, as the Linear would), the fp32 log-sum-exp and summed loss, and at once the
gradient of the loss with respect to those logits, hence the chunk's input gradient (written into its rows
of one buffer) and its share of the weight gradient (added in place into one fp32 accumulator by addmm: no
[vocab, dim] partial per chunk). Backward then only scales the two saved gradients, in place, by the
incoming one: the projection is not recomputed (a checkpoint-per-chunk variant would recompute
2 * dim * vocab FLOPs per token, about 7% of a 1B-parameter step). What stays alive until backward: the
input gradient [tokens, dim] in the compute dtype and the weight gradient [vocab, dim] in the weight's dtype: an
fp32 weight under autocast gets the fp32 accumulator itself (no round trip through the compute dtype).

Speed (scripts/bench_loss_head.py): every chunk reads and writes the whole accumulator, so chunks are
large, whole multiples of 128 tokens, as many as the plan's headroom affords, down to one chunk
(core/loss_head.py's rule); on CUDA the chunk's softmax-gradient body
is compiled (fused into a couple of passes over the logits) where Triton can build, else eager.

`OutputHead` is the model's output Linear (same parameter, same checkpoint key) whose forward also takes
the targets and then returns the summed loss: called as a module, so FSDP2 gathers its weight around it.
Where the weight is a tensor-parallel DTensor or the Linear was swapped (float8), the model keeps the
dense loss (`dense_loss_sum`); so does a pipeline's last stage, whose schedule computes the loss
(core/loss_head.py states the rule the plan shares).
"""

from __future__ import annotations

import functools
import os
import shutil
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from trainctl.core import loss_head as rule

IGNORE_INDEX = -100  # F.cross_entropy's default: such targets add nothing to the loss or the gradients
COMPILE: bool | None = None  # compile the chunk body: None decides (compiled(device)); the bench may force it


def chunk_tokens(vocab_size: int, dim: int, budget: int | None = None) -> int:
    """Tokens per chunk (core/loss_head.py's rule, which the plan counts with)."""
    return rule.chunk_tokens(vocab_size, dim, budget)


def dense_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy of whole logits, the softmax in fp32 whatever the compute dtype."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), reduction="sum",
                           ignore_index=IGNORE_INDEX)


def _eager_body(logits: torch.Tensor, targets: torch.Tensor, with_grads: bool):
    """(summed loss, d loss / d logits in the logits' dtype or None) of one chunk, eagerly and in place:
    one fp32 [chunk, vocab] buffer (the logits themselves when they are fp32) holds everything."""
    work = logits.float()
    valid = targets != IGNORE_INDEX
    safe = torch.where(valid, targets, 0)
    picked = work.gather(1, safe[:, None]).squeeze(1)
    top = work.amax(dim=1)
    sums = work.sub_(top[:, None]).exp_().sum(dim=1)
    loss = ((sums.log() + top - picked) * valid).sum()  # log-sum-exp minus the target's logit
    if not with_grads:
        return loss, None
    # d/dlogits of (lse - picked): softmax minus the one-hot target; ignored tokens get zero rows.
    grad = work.div_(sums[:, None])
    grad.scatter_add_(1, safe[:, None], -torch.ones_like(top)[:, None])
    grad.mul_(valid[:, None])
    return loss, grad.to(logits.dtype)


def _pure_body(logits: torch.Tensor, targets: torch.Tensor, with_grads: bool):
    """The same as _eager_body without in-place writes, for torch.compile: it fuses the whole body into a
    couple of passes over the logits (a mutated input would cost it a copy back)."""
    work = logits.float()
    lse = torch.logsumexp(work, dim=1)
    valid = targets != IGNORE_INDEX
    safe = torch.where(valid, targets, 0)
    picked = work.gather(1, safe[:, None]).squeeze(1)
    loss = ((lse - picked) * valid).sum()
    if not with_grads:
        return loss, None
    columns = torch.arange(work.shape[1], device=work.device)
    grad = (work - lse[:, None]).exp() - (columns[None, :] == safe[:, None]).float()
    return loss, (grad * valid[:, None]).to(logits.dtype)


@functools.cache
def _can_compile() -> bool:
    """Triton builds its launcher with a C compiler and Python's headers (train/parallel/parallelize.py refuses
    train.compile without them; here the head quietly stays eager). Looked up once per process: the answer
    cannot change during a run, and the lookups are file-system calls the forward must not make."""
    compiler = os.environ.get("CC") or "cc"
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    return shutil.which(compiler.split()[0]) is not None and headers.exists()


def compiled(device: torch.device | str) -> bool:
    """Whether the chunk body runs compiled: on CUDA where a compiler and Python's headers are present.
    On CPU it stays eager: measured there (fp32, 4096 tokens x 2048 x 32768, forward + backward), the
    in-place eager body took 12.03 s and the compiled one 12.20 s, plus about 6 s of compiling."""
    if COMPILE is not None:
        return COMPILE
    return torch.device(device).type == "cuda" and _can_compile()


@functools.cache
def _compiled_body():
    return torch.compile(_pure_body)


@functools.cache
def _fp32_out_addmm(device: torch.device) -> bool:
    """Whether addmm accumulates low-precision products straight into an fp32 tensor here (CUDA's
    out_dtype addmm); probed once on small matrices, checked against the fp32 product. Fixed values,
    not random ones: the probe must not advance the device's random stream (dropout, resumed runs)."""
    try:
        a = torch.arange(128, device=device, dtype=torch.float32).reshape(8, 16).sin()
        b = torch.arange(128, device=device, dtype=torch.float32).reshape(16, 8).cos()
        acc = torch.ones(8, 8, device=device)
        torch.addmm(acc, a.bfloat16(), b.bfloat16(), out_dtype=torch.float32, out=acc)
        want = 1 + a.bfloat16().float() @ b.bfloat16().float()
        return bool(torch.allclose(acc, want, rtol=1e-5, atol=1e-5))
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _accumulate(acc: torch.Tensor, grad: torch.Tensor, hidden: torch.Tensor) -> None:
    """acc += grad.T @ hidden, in place into the one fp32 accumulator: no [vocab, dim] partial or copy.
    In a lower compute dtype: CUDA's fp32-output addmm, else the chunk's operands (not the product) in fp32."""
    if grad.dtype == acc.dtype:
        acc.addmm_(grad.t(), hidden)
    elif _fp32_out_addmm(acc.device):
        torch.addmm(acc, grad.t(), hidden, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(grad.t().float(), hidden.float())


def _chunk(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, body,
           grad_hidden: torch.Tensor | None, grad_weight: torch.Tensor | None) -> torch.Tensor:
    """One chunk of tokens: its summed loss; writes its input gradient rows and adds its weight gradient.
    A function of its own so that the chunk's buffers are freed before the next chunk's are made."""
    loss, grad = body(hidden @ weight.t(), targets, grad_hidden is not None or grad_weight is not None)
    if grad_hidden is not None:
        torch.mm(grad, weight, out=grad_hidden)
    if grad_weight is not None:
        _accumulate(grad_weight, grad, hidden)
    return loss


class LinearCrossEntropy(torch.autograd.Function):
    """sum over tokens of cross_entropy(hidden @ weight.T, targets), chunked; gradients computed in forward.

    Backward scales the saved gradients in place (they are its own): a second backward through the same
    graph (retain_graph) is refused by autograd's version check rather than given twice-scaled gradients.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                dtype: torch.dtype):
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        body = _compiled_body() if compiled(hidden.device) else _eager_body
        # The projection runs in `dtype` (autocast's); the weight is cast here, not outside the Function, so that
        # its gradient leaves the fp32 accumulator as it is for an fp32 weight: no fp32 -> bf16 -> fp32 round trip.
        projection = weight.to(dtype)
        total = torch.zeros((), device=hidden.device, dtype=torch.float32)
        grad_hidden = torch.empty(hidden.shape, device=hidden.device, dtype=hidden.dtype) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if need_weight else None
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            total += _chunk(hidden[rows], projection, targets[rows], body,
                            None if grad_hidden is None else grad_hidden[rows], grad_weight)
        del projection
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)  # no copy for an fp32 weight
        ctx.save_for_backward(grad_hidden, grad_weight)
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden.mul_(grad_total.to(grad_hidden.dtype))
        if grad_weight is not None:
            grad_weight.mul_(grad_total.to(grad_weight.dtype))
        return grad_hidden, grad_weight, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk: int | None = None) -> torch.Tensor:
    """Summed cross-entropy of hidden [..., dim] @ weight[vocab, dim].T against targets [...], fp32.

    Under torch.autocast the projection runs in the autocast dtype, as nn.Linear's would; an fp32 weight gets
    its gradient in fp32 straight from the accumulator. chunk: tokens per chunk (None: core's floor rule).
    """
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
    hidden = hidden.to(dtype)
    chunk = chunk or chunk_tokens(*weight.shape)
    with torch.autocast(device_type, enabled=False):
        return LinearCrossEntropy.apply(hidden.flatten(0, -2), weight, targets.flatten(), chunk, dtype)


class OutputHead(nn.Linear):
    """The output projection; `forward(h, targets)` returns the summed loss without whole logits.

    `chunked`: False where the fused loss does not apply (tensor parallel shards the vocabulary); the
    model then computes the dense loss from this Linear's logits.
    """

    chunked = True
    chunk: int | None = None  # tokens per chunk: the plan's (train/loop/loss.py sets it), else core's floor rule

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return super().forward(hidden)
        return linear_cross_entropy(hidden, self.weight, targets, self.chunk)
