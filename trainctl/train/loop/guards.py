"""Step guards: what the loop does with a non-finite or spiking loss, decided the same on every rank.

After backward and gradient clipping, before the optimizer step, the loop calls
`agreed_step` (one all-reduce: every rank gets the same global loss and gradient
norm) and then `StepGuard.decide`, which answers "ok" (step) or "skip" (zero the
gradients, leave weights and optimizer state as they are), or raises `NonFiniteError`.
Because all ranks feed the guard identical numbers, they all take the same branch: no
rank steps while another skips, and no rank waits in a collective another has left.

Spike detector: a robust z-score of the loss against the median and MAD (scaled by
1.4826, so it estimates a standard deviation for normal noise) of the last
`spike_window` accepted losses (finite and not a spike). It stays silent until the
history holds `min(spike_window, 10)` losses: fewer points give a median and MAD too
noisy to call anything a spike. Only upward jumps count; a falling loss is good news.
A perfectly flat history (MAD 0: repeated batches, synthetic data) must not divide by
zero, so the scale never drops below 0.1% of the median's magnitude.

With fp16 dynamic loss scaling, an inf gradient norm is the scaler's normal overflow
signal (it skips that step itself): there, pass `grad_norm=0.0` and let the guard judge
the loss only.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque

import torch
import torch.distributed as dist

from trainctl.config.schema import GuardsConfig
from trainctl.train.errors import WorkerError

log = logging.getLogger("trainctl.train")

MAD_TO_STD = 1.4826  # MAD x this estimates the standard deviation of normal noise
SPIKE_WARMUP = 10  # accepted losses needed before the detector judges (fewer if the window is smaller)
MIN_REL_SCALE = 1e-3  # the robust scale's floor, as a fraction of |median|
MIN_ABS_SCALE = 1e-8  # ... and in absolute terms, for a median of 0

DEFAULT_ADVICE = (
    "lower optim.lr (or raise schedule.warmup_steps), check the training data around this step, "
    "or set guards.nonfinite=skip to skip such steps"
)


class NonFiniteError(WorkerError):  # exit 1: stopped on purpose, not a config error
    """Training stopped on a bad step; the message names the step, the numbers and what to do."""

    def __init__(self, step: int, loss: float, grad_norm: float, reason: str, advice: str = DEFAULT_ADVICE):
        self.step, self.loss, self.grad_norm = step, loss, grad_norm
        super().__init__(
            f"step {step}: {reason} (loss={loss:.6g}, grad_norm={grad_norm:.6g}); stopped before the optimizer step, "
            f"so the weights are those of the previous step. What to do: {advice}."
        )


def _finite(loss: float, grad_norm: float) -> bool:
    return math.isfinite(loss) and math.isfinite(grad_norm)


class StepGuard:
    """Decides per optimizer step: "ok", "skip", or raise NonFiniteError, following `GuardsConfig`."""

    def __init__(self, cfg: GuardsConfig):
        self.cfg = cfg
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.loss_spikes = 0
        self.empty_batches = 0  # steps skipped because no target of the global batch counted (masked data)
        self._history: deque[float] = deque(maxlen=cfg.spike_window)

    def decide(self, step: int, loss: float, grad_norm: float) -> str:
        """Return "ok" or "skip" for this step (the caller zeroes gradients on skip); raise NonFiniteError to stop."""
        if not _finite(loss, grad_norm):
            if self.cfg.nonfinite == "stop":
                raise NonFiniteError(step, loss, grad_norm, "the loss or gradient norm is not finite")
            return self._skip(step, loss, grad_norm, "non-finite loss or gradient norm")
        zscore = self.spike_zscore(loss)
        if zscore is not None and zscore > self.cfg.spike_zscore:
            self.loss_spikes += 1
            reason = (f"loss spike: {zscore:.1f} robust deviations above the median of the last "
                      f"{len(self._history)} losses")
            if self.cfg.spike == "skip":
                return self._skip(step, loss, grad_norm, reason)
            log.warning("step %d: %s (loss=%.6g); stepping anyway (guards.spike=warn)", step, reason, loss)
            self.consecutive_skips = 0
            return "ok"
        self._accept(loss)
        return "ok"

    def spike_zscore(self, loss: float) -> float | None:
        """Robust z-score of `loss` against the accepted history; None while off or warming up."""
        if self.cfg.spike == "off" or len(self._history) < min(self.cfg.spike_window, SPIKE_WARMUP):
            return None
        median = statistics.median(self._history)
        mad = statistics.median(abs(x - median) for x in self._history)
        scale = max(MAD_TO_STD * mad, MIN_REL_SCALE * abs(median), MIN_ABS_SCALE)
        return (loss - median) / scale

    def _accept(self, loss: float) -> None:
        self.consecutive_skips = 0
        if self.cfg.spike != "off":
            self._history.append(loss)

    def _skip(self, step: int, loss: float, grad_norm: float, reason: str) -> str:
        self.skipped_steps += 1
        self.consecutive_skips += 1
        if self.consecutive_skips >= self.cfg.max_consecutive_skips:
            advice = "lower optim.lr, check the training data around this step, or raise guards.max_consecutive_skips"
            cap = self.cfg.max_consecutive_skips
            reason = (f"{self.consecutive_skips} steps in a row skipped (guards.max_consecutive_skips={cap}); "
                      f"last: {reason}")
            raise NonFiniteError(step, loss, grad_norm, reason, advice)
        counts = f"{self.consecutive_skips} in a row, {self.skipped_steps} in total"
        log.warning("step %d: skipped, %s (loss=%.6g, grad_norm=%.6g); %s", step, reason, loss, grad_norm, counts)
        return "skip"

    def note_empty(self, step: int) -> None:
        """A step whose loss masks leave no target token in the whole global batch: skipped, counted, warned (a
        mean over no tokens would be 0/0, a NaN that stops the run)."""
        self.empty_batches += 1
        log.warning("step %d: skipped: the loss masks leave no target token in the global batch (every window "
                    "sampled holds prompt tokens only); %d such steps so far", step, self.empty_batches)

    def metrics(self) -> dict:
        """Counters for the step log (prefixed: fp16 loss scaling logs its own "skipped_steps")."""
        return {"guard_skipped_steps": self.skipped_steps, "guard_loss_spikes": self.loss_spikes,
                "guard_empty_batches": self.empty_batches}

    def state_dict(self) -> dict:
        """Counters and loss history, so a resumed run judges spikes as the interrupted one would."""
        return {
            "skipped_steps": self.skipped_steps,
            "consecutive_skips": self.consecutive_skips,
            "loss_spikes": self.loss_spikes,
            "empty_batches": self.empty_batches,
            "history": list(self._history),
        }

    def load_state_dict(self, state: dict) -> None:
        self.skipped_steps = state["skipped_steps"]
        self.consecutive_skips = state["consecutive_skips"]
        self.loss_spikes = state["loss_spikes"]
        self.empty_batches = state.get("empty_batches", 0)  # absent from checkpoints written before masks
        self._history = deque(state["history"], maxlen=self.cfg.spike_window)


def agreed_step(loss: torch.Tensor, grad_norm: torch.Tensor, stop: bool, group=None) -> tuple[float, float, bool]:
    """(global mean loss, mean gradient norm, any rank asked to stop), identical on every rank of `group`.

    One all-reduce (SUM) of the three values in float64. A NaN or inf on any rank makes the sum
    non-finite, so every rank sees a non-finite step. The gradient norm is already global
    (the same on every rank); the float64 mean of identical float32 values returns that value
    exactly. Without an initialized process group this is a world of one: no communication.
    """
    if hasattr(grad_norm, "full_tensor"):  # a DTensor norm of sharded gradients
        grad_norm = grad_norm.full_tensor()
    loss = torch.as_tensor(loss).detach()
    grad_norm = torch.as_tensor(grad_norm, device=loss.device).detach()
    # torch.full fills on the device from a kernel argument; torch.tensor(float(stop), device=cuda) would be a
    # blocking host-to-device copy every step (a second host sync beside the .tolist() below).
    flag = torch.full((), float(stop), dtype=torch.float64, device=loss.device)
    values = torch.stack([loss.double().reshape(()), grad_norm.double().reshape(()), flag])
    world = 1
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size(group)
        if world > 1:
            dist.all_reduce(values, op=dist.ReduceOp.SUM, group=group)
    total_loss, total_norm, stops = values.tolist()
    return total_loss / world, total_norm / world, stops > 0
