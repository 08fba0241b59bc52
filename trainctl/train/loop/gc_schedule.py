"""Python's garbage collector at a fixed step interval, the same steps on every rank.

Left alone, the collector runs whenever allocations cross its thresholds: at a different moment on
each rank, and a rank that pauses for a full collection holds every other rank at the next collective
(a straggler that grows with the world size). Training disables automatic collection and runs a young
generation collection every `train.gc_every` steps instead (torchtitan's gc_freq does the same); a
full collection once at the start. Automatic collection comes back when the loop ends, however it ends.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable, Iterator

log = logging.getLogger("trainctl.train")


@contextlib.contextmanager
def collect_every(steps: int) -> Iterator[Callable[[int], None]]:
    """Yields `after(done)`, to call after each step; 0 leaves the collector as it is (`after` does nothing)."""
    if steps <= 0:
        yield lambda done: None
        return
    was_enabled = gc.isenabled()
    gc.disable()
    gc.collect()

    def after(done: int) -> None:
        if done % steps == 0:
            gc.collect(1)

    try:
        yield after
    finally:
        if was_enabled:
            gc.enable()
