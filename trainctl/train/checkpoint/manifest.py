"""A checkpoint directory's manifest: every file's size and sha256, written last, checked on load.

Also the file primitives a commit needs (write with fsync, fsync a directory): writing through
Python's file API keeps ENOSPC's errno, which torch.save would bury in a RuntimeError.
"""

from __future__ import annotations

import os
from pathlib import Path

from trainctl.core.checkpoints import MANIFEST, list_files, sha256, verify  # noqa: F401  (re-exported)


def write_bytes(path: Path, data: bytes) -> None:
    """Write through Python's file API and fsync: ENOSPC keeps its errno; a commit never publishes unsynced data."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def hash_files(directory: Path, names: list[str]) -> dict[str, dict]:
    return {rel: {"size": (directory / rel).stat().st_size, "sha256": sha256(directory / rel)} for rel in names}
