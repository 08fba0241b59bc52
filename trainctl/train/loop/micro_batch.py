"""What every micro-batch runs under: one builder for the plain and the pipeline path.

Around a micro-batch's forward AND backward (`around_backward`):
  gradient sync   DDP/FSDP reduce gradients on the last micro-batch of the step only;
  cp sharding     the micro-batch's tokens, targets and RoPE rows hold this cp rank's slice, and the
                  ring attention's backward runs inside too (see context_parallel.py).
Around its forward and loss only (`forward`):
  autocast        for the wrappings that compute under torch.autocast (precision.py);
  offload         saved activations to host memory until backward (train.activation_offload).
A pipeline schedule runs forward and backward itself and syncs gradients itself (cp with pp is refused up
front): it enters `forward()` around its whole schedule step, which spans the backward passes too
(harmless: backward ops run in the dtypes their forward chose, and backward saves nothing to offload).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from trainctl.config.schema import PrecisionConfig
from trainctl.core.wrapping import Wrapping
from trainctl.train.parallel.activations import activation_offload
from trainctl.train.parallel.context_parallel import sharded_sequences
from trainctl.train.parallel.parallelize import gradient_sync, unwrap
from trainctl.train.parallel.precision import autocast_for


@dataclass(frozen=True)
class MicroBatchContext:
    """Builds the contexts of one micro-batch (see module doc); built once by setup."""

    model: nn.Module  # the parallelized model (a pipeline rank: its parts)
    precision: PrecisionConfig
    wrap: Wrapping  # core.wrapping's decision: whether forward runs under autocast
    device: torch.device
    offload: bool = False  # train.activation_offload
    cp_mesh: DeviceMesh | None = None  # cp > 1: the ranks that share each sequence
    # What forward() enters for the offload: (enabled, device) -> context. A field so that a test's hook
    # (hooks.on_setup) can wrap the real one and watch it; production keeps the default.
    offload_context: Callable[[bool, torch.device], contextlib.AbstractContextManager] = activation_offload

    @property
    def cp(self) -> int:
        return self.cp_mesh.size() if self.cp_mesh is not None else 1

    @contextlib.contextmanager
    def around_backward(self, inputs: torch.Tensor, targets: torch.Tensor, last: bool) -> Iterator[torch.Tensor | None]:
        """Gradient sync (on the `last` micro-batch only) and the cp slice; yields the slice's RoPE rows."""
        with gradient_sync(self.model, enabled=last), self.sequences(inputs, targets) as freqs:
            yield freqs

    def sequences(self, inputs: torch.Tensor, targets: torch.Tensor) -> contextlib.AbstractContextManager:
        """This cp rank's slice of the sequences (a no-op yielding None without cp)."""
        return sharded_sequences(self.cp_mesh, unwrap(self.model), inputs, targets)

    def autocast(self) -> contextlib.AbstractContextManager:
        """Autocast alone: what an evaluation forward runs under."""
        return autocast_for(self.wrap, self.precision, self.device)

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Autocast and activation offload, fresh for one forward + loss (or one pipeline schedule step)."""
        with self.autocast(), self.offload_context(self.offload, self.device):
            yield
