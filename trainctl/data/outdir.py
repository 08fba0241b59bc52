"""The --out folder of `data prepare`: checked before anything is written, created, locked, and put back as
it was when the prepare is refused.

A refused prepare leaves nothing behind: a folder it created (and the parents it created) is removed, a
folder that existed (empty) is left empty. An unfinished prepare (Ctrl-C, a crash, a full disk) is kept:
the same command finishes it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

from trainctl.data.format import META_FILE, DatasetError

STATE_FILE = ".prepare-state.json"
LOCK_FILE = ".prepare.lock"  # flock-ed by the one `data prepare` writing the folder
TOKENIZER_FILE = "tokenizer.json"
OURS = (STATE_FILE, LOCK_FILE, TOKENIZER_FILE, META_FILE, "train-*.bin", "val-*.bin", "train-*.mask", "val-*.mask",
        ".*.tmp*")


def is_temporary(name: str) -> bool:
    """A half-written file of ours (a tokenizer, the record): a dotted name with .tmp in it."""
    return name.startswith(".") and ".tmp" in name


def out_path(out: str | Path) -> Path:
    """--out as an absolute path, refused in one line when no folder can be made there."""
    raw = Path(out).expanduser()
    if str(out).strip() == "":
        raise DatasetError("--out: empty; name the dataset folder to create")
    try:
        path = raw.resolve()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Python < 3.13)
        raise DatasetError(f"--out {out}: cannot resolve it ({exc}); choose another --out") from None
    if path.exists() and not path.is_dir():
        raise DatasetError(f"--out {out}: is a file; choose a folder")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise DatasetError(f"--out {out}: {existing} is a file, not a folder; choose an --out elsewhere")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise DatasetError(f"--out {out}: no permission to write in {existing}; choose an --out you can write")
    return path


class OutFolder:
    """--out while one `data prepare` writes it: made if missing, flock-ed, undone on refusal."""

    def __init__(self, path: Path):
        self.path = path
        self.created: list[Path] = []  # folders this prepare made, outermost first
        self.before: set[str] = set()
        self._lock = None

    def open(self) -> None:
        """Make the folder (and missing parents) and take its lock; a second prepare into it is refused."""
        missing = [p for p in (self.path, *self.path.parents) if not p.exists()][::-1]
        for folder in missing:
            try:
                folder.mkdir()
            except FileExistsError:
                continue  # made by someone else meanwhile: not ours to remove
            except OSError as exc:
                self.undo()
                raise DatasetError(f"--out {self.path}: cannot create {folder} ({exc.strerror or exc}); "
                                   "choose another --out") from None
            self.created.append(folder)
        lock_was_there = (self.path / LOCK_FILE).exists()
        try:
            self._lock = (self.path / LOCK_FILE).open("a")
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            busy = self._lock is not None
            self.close()
            if not busy:
                self.undo()
                raise DatasetError(f"--out {self.path}: cannot write in it ({exc.strerror or exc}); "
                                   "choose another --out") from None
            raise DatasetError(f"--out {self.path}: another `trainctl data prepare` is writing it; wait for it, "
                               "or choose another --out") from None
        # What was there before this prepare, taken under the lock: nothing of another prepare is in flux.
        self.before = {p.name for p in self.path.iterdir()} - (set() if lock_was_there else {LOCK_FILE})

    def undo(self) -> None:
        """Put --out back as it was: made folders removed, our files in a folder that existed removed."""
        if self.created:
            shutil.rmtree(self.created[0], ignore_errors=True)
            return
        for pattern in OURS:
            for path in self.path.glob(pattern):
                if path.name not in self.before and path.is_file():
                    path.unlink(missing_ok=True)

    def close(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None
