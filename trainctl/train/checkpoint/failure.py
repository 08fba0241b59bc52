"""Why a checkpoint save failed: which ranks, what error, whether the disk is full or a file passed the file size
limit (`ulimit -f`) (checkpoint.py's messages)."""

from __future__ import annotations

import errno
import resource
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
    file_limit: int | None = None  # the file size limit (bytes) a write hit (EFBIG), when that is what failed
    files: dict[str, dict] = field(default_factory=dict)  # relative path -> {"size", "sha256"}

    def fail(self, exc: BaseException, where: Path) -> None:
        self.error = self.error or describe(exc)
        self.disk_full = self.disk_full or _is_disk_full(exc, where)
        self.file_limit = self.file_limit or hit_file_limit(exc)


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


def file_size_limit() -> int | None:
    """This process's file size limit in bytes (`ulimit -f`; every rank of a node inherits it), None when unlimited.
    Python ignores SIGXFSZ, so a write past it fails with EFBIG instead of killing the process."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def hit_file_limit(exc: BaseException) -> int | None:
    """The limit, when the failure is a write past the file size limit: EFBIG in the chain, or torch's stream
    writer's "unexpected pos" (its write stopped short, the errno dropped) under a finite limit."""
    limit = file_size_limit()
    if limit is None:
        return None
    for e in _chain(exc):
        if (isinstance(e, OSError) and e.errno == errno.EFBIG) or "unexpected pos" in str(e):
            return limit
    return None


def describe(exc: BaseException) -> str:
    if isinstance(exc, CheckpointException):
        return "; ".join(f"rank {rank}: {type(e).__name__}: {e}" for rank, (e, _) in sorted(exc.failures.items()))
    return f"{type(exc).__name__}: {exc}"


def human(n: int) -> str:
    if n < 2**20:
        return f"{n / 2**10:.1f} KiB"
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
