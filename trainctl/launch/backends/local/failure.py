"""Which rank failed first, with its own error message and its log.

The source is torchelastic's error files: torchrun gives every worker one (TORCHELASTIC_ERROR_FILE), under
--log-dir as

    RUN_DIR/logs/torchrun/<rdzv run id>_<random>/attempt_<restart>/<local rank>/error.json

(one <run id>_<random> directory per torchrun: per node on Slurm, all in the shared run directory). A failing
worker writes its one-line message there (train/__main__.py), with our own fields under "trainctl": global
rank, exit code, time to the microsecond, its log, and the attempt. Of the newest attempt's files, the one
written first is the first failing rank: e.g. rank 0's DataError, not rank 1's "connection closed" that followed.

A file damaged, missing or written by someone else (torchelastic's own ErrorHandler) is read as far as it
goes, never raised. A worker killed by a signal writes none: torchrun's printed summary names it, and its "Root
Cause (first observed failure)" block, when it names a rank that a signal ended, wins over the error files its
peers wrote after (killed_first); without error files the summary is the only source. The block reads, among other
lines,

    rank      : 1 (local_rank: 1)
    exitcode  : 3 (pid: 3775)

A hang leaves no error file (the watchdog ends the process from C: core/hangs.py): the hang files of the newest
attempt name every rank whose watchdog fired, and they take precedence over errors of the same or an older attempt
(a peer's "connection closed" after the hung rank left is a consequence, not the cause).
"""

from __future__ import annotations

import re
import signal
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from trainctl.core import hangs, rundir
from trainctl.launch.command import TORCHRUN_LOG_SUBDIR

ERROR_FILE, ERROR_FILE_KEY = rundir.ERROR_FILE, rundir.ERROR_FILE_KEY  # the worker writes them (train/__main__.py)

_ROOT_CAUSE = "Root Cause"
_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)", re.MULTILINE)
_EXITCODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)", re.MULTILINE)
_ATTEMPT = re.compile(r"attempt_(\d+)")


@dataclass(frozen=True)
class Failure:
    rank: int
    local_rank: int
    exit_code: int | None  # negative: killed by that signal
    log: str  # "" when no log file was found
    message: str = ""  # the rank's own one-line error, "" when it left none
    restart: int = 0  # torchrun's restart count of the attempt that failed
    reason: str = ""  # "hang": the ranks' watchdogs fired (core/hangs.py); "" otherwise
    ranks: tuple[int, ...] = ()  # with "hang": every rank whose watchdog fired
    stacks: tuple[str, ...] = ()  # with "hang": their stack dumps

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class _ErrorFile:
    """One error.json as far as it could be read."""

    path: Path
    time: float
    attempt: tuple  # which start of the workers wrote it: files of one attempt share it
    rank: int | None
    local_rank: int
    exit_code: int | None
    message: str
    log: str


def _read_error_file(path: Path) -> _ErrorFile | None:
    """An error file's content, tolerating anything: None only when the file cannot be read at all."""
    try:
        mtime = path.stat().st_mtime
    except OSError:
        return None
    data = rundir.read_json(path)
    ours = data.get(ERROR_FILE_KEY) if isinstance(data.get(ERROR_FILE_KEY), dict) else {}
    message = data.get("message")
    extra = message.get("extraInfo") if isinstance(message, dict) else None
    text = rundir.as_str(message.get("message")) if isinstance(message, dict) else rundir.as_str(message)
    seconds = rundir.as_float(rundir.as_int(extra.get("timestamp")) if isinstance(extra, dict) else None)
    local_rank = rundir.as_int(path.parent.name, 0)
    torchrun_dir = path.parent.parent.parent.name
    attempt_match = _ATTEMPT.fullmatch(path.parent.parent.name)
    attempt = (
        rundir.as_str(ours.get("run_id")) or torchrun_dir.rsplit("_", 1)[0],
        rundir.as_int(ours.get("restart"), int(attempt_match.group(1)) if attempt_match else 0),
        rundir.as_int(ours.get("slurm_restart"), 0),
    )
    return _ErrorFile(
        path=path,
        time=rundir.as_float(ours.get("time")) or seconds or mtime,
        attempt=attempt,
        rank=rundir.as_int(ours.get("rank")),
        local_rank=rundir.as_int(ours.get("local_rank"), local_rank),
        exit_code=rundir.as_int(ours.get("exit_code")),
        message=" ".join(text.split()),
        log=rundir.as_str(ours.get("log")),
    )


def error_files(run_dir: Path) -> list[Path]:
    try:
        return sorted((Path(run_dir) / TORCHRUN_LOG_SUBDIR).glob(f"*/attempt_*/*/{ERROR_FILE}"))
    except OSError:
        return []


def first_failure(run_dir: Path, since: float | None = None) -> Failure | None:
    """The first rank to fail in the newest attempt that left error files (written at or after `since`, a
    time.time(), when given: a launch passes its start so that an older launch's files never answer)."""
    found = [f for f in map(_read_error_file, error_files(run_dir)) if f is not None]
    if since is not None:
        found = [f for f in found if f.time >= since - 1.0]  # torchelastic's own timestamps are whole seconds
    if not found:
        return None
    newest = max(found, key=lambda f: f.time).attempt
    first = min((f for f in found if f.attempt == newest), key=lambda f: f.time)
    rank = first.rank if first.rank is not None else first.local_rank  # torchelastic's own file names no rank
    log = first.log if first.log and Path(first.log).is_file() else _log_of(run_dir, rank, first.path.parent)
    return Failure(rank=rank, local_rank=first.local_rank, exit_code=first.exit_code, log=log, message=first.message,
                   restart=first.attempt[1])


def hang_failure(run_dir: Path, since: float | None = None) -> Failure | None:
    """The newest attempt's hang (every rank whose watchdog fired, dumped at or after `since`), if there was one."""
    hung = hangs.newest_attempt_hangs(run_dir, since)
    if not hung:
        return None
    first = min(hung, key=lambda h: h.time)
    ranks = tuple(h.rank for h in hung)
    message = (f"no progress for {first.timeout_s:g} s (train.hang_timeout_s) on rank{'s' if len(ranks) > 1 else ''} "
               f"{', '.join(map(str, ranks))}; every thread's stack: {', '.join(str(h.path) for h in hung)}")
    return Failure(rank=first.rank, local_rank=first.rank, exit_code=1, log=_log_of(run_dir, first.rank, first.path),
                   message=message, restart=first.attempt.restart, reason="hang", ranks=ranks,
                   stacks=tuple(str(h.path) for h in hung))


def _log_of(run_dir: Path, rank: int, captured: Path) -> str:
    """The rank's own log, else the stderr torchrun captured next to its error file."""
    own = Path(run_dir) / rundir.LOGS / f"rank{rank}.log"
    for path in (own, captured / "stderr.log"):
        if path.is_file():
            return str(path)
    return ""


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
    """The most useful log of a rank: its own log, else torchrun's capture of its stderr (newest attempt)."""
    own = run_dir / rundir.LOGS / f"rank{rank}.log"
    if own.is_file():
        return own
    captured = []
    for path in (run_dir / TORCHRUN_LOG_SUBDIR).glob(f"*/attempt_*/{local_rank}/stderr.log"):
        try:
            captured.append((path.stat().st_mtime, path))
        except OSError:
            continue
    return max(captured)[1] if captured else None


def killed_first(output: str, run_dir: Path, failure: Failure) -> Failure | None:
    """torchrun's root cause when it is another rank than the error files' and one ended by a signal: a rank killed
    from outside (kill -9, the kernel's out-of-memory killer) writes no error file, and what its peers wrote after it
    died (a connection reset by the dead peer) is the consequence, not the cause."""
    parsed = parse_root_cause(output)
    if parsed is None or parsed[2] is None or parsed[2] >= 0 or parsed[0] == failure.rank:
        return None
    rank, local_rank, code = parsed
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    log = rank_log(run_dir, rank, local_rank)
    message = (f"killed by {name} (a rank killed from outside, e.g. kill -9 or the out-of-memory killer, writes no "
               f"error of its own); then rank {failure.rank}: {failure.message}")
    return Failure(rank=rank, local_rank=local_rank, exit_code=code, log=str(log) if log else "", message=message,
                   restart=failure.restart)


def find_failure(output: str, run_dir: Path, since: float | None = None) -> Failure | None:
    """The first failing rank: from the error files (see first_failure), else from torchrun's printed summary."""
    failure, hang = first_failure(run_dir, since), hang_failure(run_dir, since)
    if hang is not None and (failure is None or hang.restart >= failure.restart):  # not an older attempt's hang
        return hang
    if failure is not None:
        if (killed := killed_first(output, run_dir, failure)) is not None:
            return killed
        if failure.exit_code is None:  # a file torchelastic wrote for us: torchrun's summary has the code
            parsed = parse_root_cause(output)
            if parsed is not None and parsed[0] == failure.rank:
                failure = replace(failure, exit_code=parsed[2])
        return failure
    parsed = parse_root_cause(output)
    if parsed is None:
        return None
    rank, local_rank, exit_code = parsed
    log = rank_log(run_dir, rank, local_rank)
    return Failure(rank=rank, local_rank=local_rank, exit_code=exit_code, log=str(log) if log else "")
