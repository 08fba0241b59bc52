"""A started run as a value: where it is, which backend runs it, and (for a run here) its output and end."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

OUTPUT_LINES = 2000  # the tail of a run's console output a handle keeps (the whole of it is in RUN_DIR/logs/)


class OutputTail:
    """A binary sink for a run's console output: keeps the last lines and hands each chunk to `on_output`."""

    def __init__(self, on_output: Callable[[bytes], None] | None = None):
        self._lines: deque[bytes] = deque(maxlen=OUTPUT_LINES)
        self._lock = threading.Lock()
        self._on_output = on_output

    def write(self, data: bytes) -> int:
        with self._lock:
            self._lines.extend(data.splitlines(keepends=True))
        if self._on_output is not None:
            self._on_output(bytes(data))
        return len(data)

    def flush(self) -> None:
        pass

    def text(self) -> str:
        with self._lock:
            return b"".join(self._lines).decode(errors="replace")


@dataclass
class LaunchHandle:
    """A launched run. `exit_code` is known once a run started here has ended (`done`); a queued run has a
    `job_id` instead and is watched with `api.status(handle.name)`."""

    run_dir: Path
    backend: str
    job_id: str = ""
    message: str = ""  # one line for the user (how to follow a queued run), plain text
    exit_code: int | None = None
    report: str = ""  # the launcher's last line for a run here that did not complete
    output: OutputTail | None = None  # a run started here without waiting: its console output's tail
    _thread: threading.Thread | None = field(default=None, repr=False)
    _error: BaseException | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.run_dir.name

    @property
    def done(self) -> bool:
        """Whether this process has nothing more to wait for (a queued run may still be running on its cluster)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait up to `timeout` seconds for a run started here to end; its exit code (None: still running, or
        queued). Re-raises what stopped the launcher itself (e.g. the run's lock taken by another trainer)."""
        if self._thread is not None:
            self._thread.join(timeout)
        if self._error is not None:
            raise self._error
        return self.exit_code
