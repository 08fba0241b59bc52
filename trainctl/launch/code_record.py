"""A record of the code a run was launched with: git sha, branch, dirty flag and diff.

The repository is the one holding the trainctl package (not the current
directory). Untracked files do not make the tree dirty (run directories and
caches usually live untracked next to the code); they are listed by name only.
Without git, or outside a checkout, the record says so and nothing fails.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import trainctl

GIT_TIMEOUT_S = 20


@dataclass(frozen=True)
class CodeRecord:
    git: bool  # False: not a git checkout, or git is not installed
    sha: str = ""
    branch: str = ""
    dirty: bool = False
    untracked: tuple[str, ...] = ()
    diff: str = ""  # `git diff HEAD`, only when dirty

    def to_dict(self) -> dict:
        """Everything but the diff, which goes to its own file."""
        return {"git": self.git, "sha": self.sha, "branch": self.branch, "dirty": self.dirty,
                "untracked": list(self.untracked)}


def package_dir() -> Path:
    return Path(trainctl.__file__).resolve().parent


def _git(repo: Path, *args: str) -> str | None:
    """stdout of a git command in `repo`, or None when it fails."""
    try:
        done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=GIT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def record(source: Path | None = None) -> CodeRecord:
    """Describe the checkout holding `source` (default: the trainctl package)."""
    source = source or package_dir()
    if shutil.which("git") is None:
        return CodeRecord(git=False)
    sha = _git(source, "rev-parse", "HEAD")
    if sha is None:
        return CodeRecord(git=False)
    branch = (_git(source, "rev-parse", "--abbrev-ref", "HEAD") or "").strip()
    changed = _git(source, "status", "--porcelain", "--untracked-files=no") or ""
    untracked = _git(source, "ls-files", "--others", "--exclude-standard", "--full-name") or ""
    dirty = bool(changed.strip())
    diff = (_git(source, "diff", "HEAD") or "") if dirty else ""
    return CodeRecord(git=True, sha=sha.strip(), branch=branch, dirty=dirty, untracked=tuple(untracked.splitlines()),
                      diff=diff)
