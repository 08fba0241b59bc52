"""Stub executables for unit tests (the `slurm_bin` fixture in conftest.py puts stub Slurm clients on PATH)."""

from __future__ import annotations

from pathlib import Path


def write_exe(path: Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)
