"""Why a checkpoint save failed: which ranks, what error, whether the disk is full (checkpoint.py's messages)."""

from __future__ import annotations

import errno
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

# DCP's CheckpointException derives from BaseException, so `except Exception` alone lets it through.
SAVE_ERRORS = (Exception, CheckpointException)


@dataclass
class Part:
    """What one rank reports about its share of a save."""

    error: str | None = None
    disk_full: bool = False
    files: dict[str, dict] = field(default_factory=dict)  # relative path -> {"size", "sha256"}

    def fail(self, exc: BaseException, where: Path) -> None:
        self.error = self.error or describe(exc)
        self.disk_full = self.disk_full or _is_disk_full(exc, where)


def _chain(exc: BaseException):
    """exc, its causes and contexts, and the per-rank failures a CheckpointException carries."""
    stack, seen = [exc], set()
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        stack += [current.__cause__, current.__context__]
        if isinstance(current, CheckpointException):
            stack += [failure[0] for failure in current.failures.values()]


def _is_disk_full(exc: BaseException, where: Path) -> bool:
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
    # torch.save reports a failed write as a RuntimeError ("unexpected pos"), the OSError only its
    # __context__, and DCP pickles other ranks' exceptions, contexts dropped: judge by the space left.
    try:
        usage = shutil.disk_usage(where if where.exists() else where.parent)
    except OSError:
        return False
    return usage.free < min(64 << 20, usage.total // 100)


def describe(exc: BaseException) -> str:
    if isinstance(exc, CheckpointException):
        return "; ".join(f"rank {rank}: {type(e).__name__}: {e}" for rank, (e, _) in sorted(exc.failures.items()))
    return f"{type(exc).__name__}: {exc}"


def human(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
