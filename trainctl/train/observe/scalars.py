"""One naming of the logged scalars, shared by TensorBoard and W&B: `train/loss`, `eval/loss`, `perf/mfu`, ...

metrics.jsonl keeps each record's own flat keys (what `runs`, `status` and `plot` read); the dashboards get
namespaced names so that related curves group together.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from trainctl.core import rundir

log = logging.getLogger(__name__)

# (record kind, key) -> scalar name; other numeric keys become "<kind>/<key>".
NAMES = {
    ("train", "loss"): "train/loss",
    ("train", "lr"): "train/lr",
    ("train", "grad_norm"): "train/grad_norm",
    ("train", "tokens_seen"): "train/tokens_seen",
    ("train", "loss_scale"): "train/loss_scale",
    ("train", "tokens_per_s"): "perf/tokens_per_s",
    ("train", "step_time_s"): "perf/step_time_s",
    ("train", "mfu"): "perf/mfu",
    ("train", "peak_mem_gib"): "memory/peak_gib",
    ("train", "peak_reserved_gib"): "memory/peak_reserved_gib",
    ("eval", "val_loss"): "eval/loss",
}
SKIPPED = {"step", "kind"}


def scalars(record: dict) -> dict[str, float]:
    """The numeric values of a record under their namespaced names (booleans, lists and text left out)."""
    kind = record.get("kind", "")
    out = {}
    for key, value in record.items():
        if key in SKIPPED or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if key.startswith("guard_"):
            name = f"guard/{key.removeprefix('guard_')}"
        else:
            name = NAMES.get((kind, key), f"{kind}/{key}")
        out[name] = value
    return out


def tensorboard_available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


class TensorBoard:
    """Event files in RUN_DIR/tensorboard; a resume hides what an earlier attempt logged past its checkpoint."""

    def __init__(self, run_dir: Path):
        self._dir = run_dir / rundir.TENSORBOARD
        self._writer = None

    def _open(self, purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(self._dir), purge_step=purge_step)

    def resumed(self, step: int) -> None:
        """Events of steps after `step` (an earlier attempt's) are purged by TensorBoard's readers."""
        self.close()
        self._open(purge_step=step + 1)

    def log(self, values: dict[str, float], step: int) -> None:
        if self._writer is None:
            self._open()
        for name, value in values.items():
            self._writer.add_scalar(name, value, global_step=step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
