"""The one definition of a committed checkpoint, torch-free: used by the worker, `resume`, `export` and the CLI.

A checkpoint directory `RUN_DIR/checkpoints/step-NNNNNNNN` is *committed* when its name matches
exactly (never `.tmp`) and it holds `manifest.json`; it is *valid* when every file the manifest
lists has the listed size and sha256 and no other file is present. The worker writes the
manifest last and renames `.tmp` away only after it, so a committed name means a finished save,
and verification catches what happened to the bytes since.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
META = "meta.json"
TMP_SUFFIX = ".tmp"
STEP_RE = re.compile(r"step-(\d{8,})")
_HASH_CHUNK = 4 << 20


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def step_of(path: Path) -> int | None:
    """The step a committed-looking name stands for, or None (`.tmp`, other names)."""
    match = STEP_RE.fullmatch(Path(path).name)
    return int(match.group(1)) if match else None


def list_committed(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every committed checkpoint directly under `root`, oldest first; never raises."""
    try:
        entries = list(Path(root).iterdir())
    except OSError:
        return []
    found = []
    for path in entries:
        step = step_of(path)
        try:
            if step is not None and (path / MANIFEST).is_file():
                found.append((step, path))
        except OSError:
            continue
    return sorted(found)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def list_files(directory: Path) -> list[str]:
    return sorted(p.relative_to(directory).as_posix() for p in Path(directory).rglob("*") if p.is_file())


def _check_file(path: Path, rel: str, want: dict) -> list[str]:
    try:
        size = path.stat().st_size
        if size != want["size"]:
            return [f"{rel}: {size} bytes, the manifest says {want['size']}"]
        if sha256(path) != want["sha256"]:
            return [f"{rel}: content differs from the manifest (sha256)"]
    except FileNotFoundError:
        return [f"{rel}: missing"]
    except OSError as exc:
        return [f"{rel}: unreadable ({exc.strerror or exc})"]
    except (KeyError, TypeError):
        return [f"{rel}: the manifest's entry is malformed"]
    return []


def read_manifest(path: Path) -> dict[str, dict]:
    """The manifest's {relative path: {size, sha256}}; raises ValueError on anything else."""
    try:
        files = json.loads((Path(path) / MANIFEST).read_text())["files"]
    except OSError as exc:
        raise ValueError(f"{MANIFEST} unreadable ({exc.strerror or exc})") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{MANIFEST} unreadable (not a manifest: {exc.__class__.__name__})") from None
    if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
        raise ValueError(f"{MANIFEST} unreadable (not a manifest: files is not a mapping of entries)")
    return files


def verify(path: Path, part: int = 0, parts: int = 1) -> list[str]:
    """Problems of checkpoint `path` against its manifest: missing, extra, resized or altered files (empty: valid).

    part/parts: check every parts-th file from the part-th (ranks share the hashing); part 0 also looks for
    extra files and for a manifest that lists nothing.
    """
    path = Path(path)
    try:
        files = read_manifest(path)
    except ValueError as exc:
        return [str(exc)]
    problems = []
    if part == 0:
        if not files:
            problems.append(f"{MANIFEST} lists no files")
        try:
            extra = sorted(set(list_files(path)) - set(files) - {MANIFEST})
        except OSError as exc:
            extra, problems = [], [*problems, f"unreadable directory ({exc.strerror or exc})"]
        problems += [f"{rel}: not in the manifest" for rel in extra]
    for rel, want in sorted(files.items())[part::parts]:
        problems += _check_file(path / rel, rel, want)
    return problems


@dataclass(frozen=True)
class Choice:
    """The newest valid checkpoint of a run (None when there is none) and the newer ones skipped, with why."""

    path: Path | None
    step: int | None
    skipped: tuple[tuple[Path, str], ...] = ()


def newest_valid(run_dir: Path) -> Choice:
    """The run's newest committed checkpoint that verifies; every newer one that did not, with its first problem."""
    skipped = []
    for step, path in reversed(list_committed(checkpoint_dir(run_dir))):
        problems = verify(path)
        if not problems:
            return Choice(path, step, tuple(skipped))
        skipped.append((path, problems[0]))
    return Choice(None, None, tuple(skipped))
