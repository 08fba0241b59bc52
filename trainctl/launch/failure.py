"""Which rank failed, and where its log is, from torchrun's error summary.

A failed torchrun ends with a summary whose "Root Cause (first observed
failure)" block reads, among other lines:

    rank      : 1 (local_rank: 1)
    exitcode  : 3 (pid: 3775)

The log we point at is the worker's own RUN_DIR/logs/rank{R}.log when it
exists; otherwise the stderr torchrun captured for that local rank under
RUN_DIR/logs/torchrun/ (the newest attempt), e.g. when the worker died before
opening its log.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path

from trainctl.launch.command import TORCHRUN_LOG_SUBDIR

_ROOT_CAUSE = "Root Cause"
_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)", re.MULTILINE)
_EXITCODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)", re.MULTILINE)


@dataclass(frozen=True)
class Failure:
    rank: int
    local_rank: int
    exit_code: int | None  # negative: killed by that signal
    log: str  # "" when no log file was found

    def to_dict(self) -> dict:
        return asdict(self)


def parse_root_cause(output: str) -> tuple[int, int, int | None] | None:
    """(rank, local_rank, exit code) of torchrun's root-cause failure, or None when the summary is absent."""
    start = output.rfind(_ROOT_CAUSE)
    if start < 0:
        return None
    block = output[start:]
    rank = _RANK.search(block)
    if rank is None:
        return None
    exitcode = _EXITCODE.search(block)
    return int(rank.group(1)), int(rank.group(2)), int(exitcode.group(1)) if exitcode else None


def rank_log(run_dir: Path, rank: int, local_rank: int) -> Path | None:
    """The most useful log of a rank: its own log, else torchrun's capture of its stderr."""
    own = run_dir / "logs" / f"rank{rank}.log"
    if own.is_file():
        return own
    captured = list((run_dir / TORCHRUN_LOG_SUBDIR).glob(f"*/attempt_*/{local_rank}/stderr.log"))
    if not captured:
        return None
    return max(captured, key=lambda p: p.stat().st_mtime)


def find_failure(output: str, run_dir: Path) -> Failure | None:
    """The failed rank named in torchrun's output, with its log; None when the output names none."""
    parsed = parse_root_cause(output)
    if parsed is None:
        return None
    rank, local_rank, exit_code = parsed
    log = rank_log(run_dir, rank, local_rank)
    return Failure(rank=rank, local_rank=local_rank, exit_code=exit_code, log=str(log) if log else "")
