"""A rich progress bar with ETA for a local run, drawn by the launcher.

Under torchrun the workers' stdout is a pipe, never a terminal, so the bar lives here:
rank 0's streamed lines are printed above it, and its position comes from the
records rank 0 appends to RUN_DIR/metrics.jsonl (read after each chunk of output,
which the worker prints right after writing the record).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from trainctl.core import rundir

POLL_S = 0.25


class ProgressSink:
    """A binary sink for `stream_output` that prints lines above a live progress bar."""

    def __init__(self, run_dir: Path, total_steps: int, console: Console | None = None,
                 poll_s: float = POLL_S):
        self._run_dir = run_dir
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
        # The bar moves every step: rank 0 rewrites progress.json as steps finish (train records come every
        # log_every steps only).
        self._stopped = threading.Event()
        self._poller = threading.Thread(target=self._poll_progress, args=(poll_s,), daemon=True)
        self._poller.start()

    def _poll_progress(self, every: float) -> None:
        while not self._stopped.wait(every):
            step = rundir.progress_step(self._run_dir)
            if step is not None and step > self.step:
                self.step = step
                self._progress.update(self._task, completed=step)

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
        self._stopped.set()
        self._poller.join()
        if self._pending:
            self.write(b"\n")
        self._poll_metrics()
        self._progress.stop()

    def _poll_metrics(self) -> None:
        """Advance the bar to the newest complete train record."""
        f = rundir.open_regular(self._metrics)
        if f is None:
            return  # not there yet: the bar waits, the output keeps streaming
        try:
            with f:
                identity = os.fstat(f.fileno()).st_ino
                if identity != self._inode or os.fstat(f.fileno()).st_size < self._offset:
                    # A resume rewrote the file (dropping records past its step): read the new one from its start.
                    self._inode, self._offset, self.step = identity, 0, 0
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
            self.step = max(self.step, step)  # progress.json may already be ahead
            loss = rundir.as_float(record.get("loss"))
            self._progress.update(self._task, completed=self.step,
                                  description="" if loss is None else f"loss {loss:.4f}")
