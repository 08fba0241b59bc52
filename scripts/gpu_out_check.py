"""Will everything under $OUT come back from the device tool? Its limits, checked before the call ends.

    python scripts/gpu_out_check.py "$OUT"      # prints the listing; exit 1 with one line per problem

The device tool returns at most 8 files, each at most 16 MiB and 64 MiB together, no deeper than two folders
($OUT/a/b/file), named in letters, digits, '.', '_' and '-'. Anything else is silently left behind, so
gpu_proof.sh fails here instead (stdlib only: it runs under the GPU image's Python as it is).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

MAX_FILES = 8
MAX_FILE_BYTES = 16 * 2**20
MAX_TOTAL_BYTES = 64 * 2**20
MAX_FOLDERS = 2
NAME = re.compile(r"[A-Za-z0-9._-]+")


def problems(out: Path) -> list[str]:
    """What would not come back from `out`, one line each (empty: all of it comes back)."""
    found, total = [], 0
    files = []
    for path in sorted(out.rglob("*")):
        relative = path.relative_to(out)
        bad = [part for part in relative.parts if not NAME.fullmatch(part)]
        if bad:
            found.append(f"{relative}: name {bad[0]!r} has characters other than letters, digits, '.', '_', '-'")
        if path.is_symlink() or not (path.is_dir() or path.is_file()):
            found.append(f"{relative}: not a plain file or folder")
            continue
        if path.is_dir():
            continue
        files.append(relative)
        size = path.stat().st_size
        total += size
        if len(relative.parts) - 1 > MAX_FOLDERS:
            found.append(f"{relative}: {len(relative.parts) - 1} folders deep; at most {MAX_FOLDERS} come back")
        if size > MAX_FILE_BYTES:
            found.append(f"{relative}: {size / 2**20:.1f} MiB; at most {MAX_FILE_BYTES // 2**20} MiB a file")
    if len(files) > MAX_FILES:
        found.append(f"{len(files)} files; at most {MAX_FILES} come back")
    if total > MAX_TOTAL_BYTES:
        found.append(f"{total / 2**20:.1f} MiB in all; at most {MAX_TOTAL_BYTES // 2**20} MiB come back")
    return found


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        print(f"  {path.stat().st_size:>10}  {path.relative_to(out)}")
    found = problems(out)
    for line in found:
        print(f"$OUT limit: {line}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
