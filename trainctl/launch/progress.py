"""A rich progress bar with ETA for a local run, drawn by the launcher.

Under torchrun the workers' stdout is a pipe, never a terminal, so the bar lives here:
rank 0's streamed lines are printed above it, and its position comes from the
records rank 0 appends to RUN_DIR/metrics.jsonl (read after each chunk of output,
which the worker prints right after writing the record).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from trainctl.core import rundir


class ProgressSink:
    """A binary sink for `stream_output` that prints lines above a live progress bar."""

    def __init__(self, run_dir: Path, total_steps: int, console: Console | None = None):
        self._metrics = run_dir / rundir.METRICS
        self._offset = 0
        self._inode = None
        self._pending = b""
        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.description}"),
            console=console,
            transient=False,
        )
        self._task = self._progress.add_task("", total=total_steps)
        self.step = 0
        self._progress.start()

    def write(self, chunk: bytes) -> None:
        lines = (self._pending + chunk).split(b"\n")
        self._pending = lines.pop()
        for line in lines:
            text = line.decode(errors="replace").rstrip("\r")
            self._progress.console.print(text, markup=False, highlight=False, soft_wrap=True)
        self._poll_metrics()

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self._pending:
            self.write(b"\n")
        self._poll_metrics()
        self._progress.stop()

    def _poll_metrics(self) -> None:
        """Advance the bar to the newest complete train record."""
        try:
            with self._metrics.open("rb") as f:
                identity = os.fstat(f.fileno()).st_ino
                if identity != self._inode or os.fstat(f.fileno()).st_size < self._offset:
                    # A resume rewrote the file (dropping records past its step): read the new one from its start.
                    self._inode, self._offset = identity, 0
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return  # not there yet, or unreadable: the bar waits, the output keeps streaming
        complete = data[: data.rfind(b"\n") + 1]  # a record still being written waits for the next poll
        self._offset += len(complete)
        for raw in complete.splitlines():
            try:
                record = json.loads(raw)
            except ValueError:
                continue
            step = rundir.as_int(record.get("step")) if isinstance(record, dict) else None
            if step is None or record.get("kind") != "train":
                continue  # a damaged or foreign line must not stop the output
            self.step = step
            loss = rundir.as_float(record.get("loss"))
            self._progress.update(self._task, completed=step, description="" if loss is None else f"loss {loss:.4f}")
