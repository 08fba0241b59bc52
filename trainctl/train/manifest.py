"""A checkpoint directory's manifest: every file's size and sha256, written last, checked on load.

Also the file primitives a commit needs (write with fsync, fsync a directory): writing through
Python's file API keeps ENOSPC's errno, which torch.save would bury in a RuntimeError.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST = "manifest.json"
_HASH_CHUNK = 4 << 20


def write_bytes(path: Path, data: bytes) -> None:
    """Write through Python's file API and fsync: ENOSPC keeps its errno, and the commit never publishes unsynced data."""
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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def list_files(directory: Path) -> list[str]:
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())


def hash_files(directory: Path, names: list[str]) -> dict[str, dict]:
    return {rel: {"size": (directory / rel).stat().st_size, "sha256": _sha256(directory / rel)} for rel in names}


def _check_file(path: Path, rel: str, want: dict) -> list[str]:
    try:
        size = path.stat().st_size
        if size != want["size"]:
            return [f"{rel}: {size} bytes, the manifest says {want['size']}"]
        if _sha256(path) != want["sha256"]:
            return [f"{rel}: content differs from the manifest (sha256)"]
    except FileNotFoundError:
        return [f"{rel}: missing"]
    except OSError as exc:
        return [f"{rel}: unreadable ({exc})"]
    return []


def verify(path: Path, part: int = 0, parts: int = 1) -> list[str]:
    """Problems of checkpoint `path` against its manifest: missing, extra, resized or altered files (empty: valid).

    part/parts: check every parts-th file from the part-th (ranks share the hashing); part 0 also looks for extra files.
    """
    path = Path(path)
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
        wanted = sorted(files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return [f"{MANIFEST} unreadable ({exc})"]
    problems = []
    if part == 0:
        extra = sorted(set(list_files(path)) - set(files) - {MANIFEST})
        problems += [f"{rel}: not in the manifest" for rel in extra]
    for rel, want in wanted[part::parts]:
        problems += _check_file(path / rel, rel, want)
    return problems
