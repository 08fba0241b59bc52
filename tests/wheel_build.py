"""A wheel built from a clean copy of the checkout: the files git tracks, plus new ones it does not ignore.

Building in the checkout itself would reuse its build/ folder (files of an earlier build end up in the wheel)
and leave build/ and *.egg-info behind; the copy holds exactly the source a fresh clone would, with the
working tree's edits.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO

SHIPPED_FOLDERS = ("conf", "recipes")  # top-level in a checkout, trainctl/<name>/ in a wheel


def clean_copy(dest: Path) -> Path:
    """Copy the checkout's source (tracked and untracked-but-not-ignored files) into `dest`."""
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True, timeout=60).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        src = REPO / rel
        if src.is_file() or src.is_symlink():  # a tracked file deleted in the working tree is left out
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel, follow_symlinks=False)
    return dest


def build_wheel(source: Path, out: Path, timeout: float = 300) -> Path:
    """`pip wheel` of `source` with this interpreter's setuptools (no network, no dependencies)."""
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "--disable-pip-version-check", "-w", str(out), str(source)],
                          cwd=out.parent, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (wheel,) = out.glob("trainctl-*.whl")
    return wheel


def shipped_in_wheel(source: Path) -> set[str]:
    """The shipped config files of a source tree, by the names a wheel must hold them under."""
    return {f"trainctl/{p.relative_to(source).as_posix()}" for name in SHIPPED_FOLDERS
            for p in (source / name).rglob("*.yaml")}
