"""The run directory's layout, tolerant readers and writers: the only code that names its files.

    RUN_DIR/
      config.yaml       the resolved config; the only input of the workers
      plan.json         the run plan
      launch.sh         the launch: a bash script (local) or an sbatch script (slurm); finds RUN_DIR from its own path
      overrides.txt     the user's command-line overrides, one per line
      code.json         git sha, branch, dirty flag of the trainctl checkout (code.diff when dirty)
      launch.json       the launcher's record: local pid, host and start time (exit code at the end), or a Slurm job id
      trainer.lock      held (flock) by the one process training in this directory: a launch, `resume`, `bash launch.sh`
      trainer.json      who holds the lock: pid, host, start time, Slurm job id
      stopped.json      the worker's record of a stop on request (signal, step, checkpoint)
      metrics.jsonl     rank 0's records, one JSON object per line
      result.json       the final summary: the run finished
      wandb_id          the W&B run id, kept across restarts
      slurm-attempts.jsonl  one line per Slurm attempt start and end
      history/          what a `trainctl resume` with overrides replaced: earlier config.yaml, plan.json, result.json
      checkpoints/      step-NNNNNNNN (committed, see core.checkpoints); .tmp while being written
      logs/             rank{R}.log, torchrun/ (every rank's captured output and error files), slurm-*.out,
                        launcher.log (all a local launch printed, torchrun's own messages included),
                        hangs/ (one file per rank and attempt: the hang watchdog's stack dump, core/hangs.py)

Readers here never raise for what is inside a file: a missing, truncated or wrongly shaped file reads as
"absent" (None, {} or []), so one damaged run never hides the others.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

CONFIG = "config.yaml"
PLAN = "plan.json"
SCRIPT = "launch.sh"
OVERRIDES = "overrides.txt"
CODE = "code.json"
CODE_DIFF = "code.diff"
LAUNCH = "launch.json"
LOCK = "trainer.lock"
HOLDER = "trainer.json"
STOPPED = "stopped.json"
METRICS = "metrics.jsonl"
RESULT = "result.json"
LM_EVAL = "lm_eval.json"  # trainctl eval --tasks: lm-evaluation-harness metrics per task, and the step
WANDB_ID = "wandb_id"
TENSORBOARD = "tensorboard"  # TensorBoard event files (rank 0)
PROGRESS = "progress.json"  # rank 0's latest finished step, rewritten at most twice a second (the live bar)
ATTEMPTS = "slurm-attempts.jsonl"
LOGS = "logs"
TORCHRUN_LOGS = "logs/torchrun"
LAUNCHER_LOG = "logs/launcher.log"
HANGS = "logs/hangs"  # the hang watchdog's files: HANGS/<attempt>.rank<R>.txt (hang_file)
ERROR_FILE = "error.json"  # torchelastic's per-worker error file: TORCHRUN_LOGS/<run id>/attempt_<n>/<local rank>/
ERROR_FILE_KEY = "trainctl"  # the worker's fields in it, beside torchelastic's "message" (backends/local/failure.py)
CHECKPOINTS = "checkpoints"
HISTORY = "history"
TOKENIZER = "tokenizer"  # the tokenizer files the run trained with (copies), and their sha256 in record.json
TOKENIZER_RECORD = "tokenizer/record.json"

RUN_DIR_ENV = "TRAINCTL_RUN_DIR"  # set by launch.sh from its own location; the worker checks it against its argument
TAIL_BYTES = 256 * 1024  # the end of metrics.jsonl that holds the recent steps


def is_run_dir(path: Path) -> bool:
    try:
        return (Path(path) / CONFIG).is_file()
    except OSError:
        return False


# ---------------------------------------------------------------- tolerant readers

MAX_JSON_BYTES = 16 << 20  # a record larger than this is not one trainctl wrote: it reads as absent
MAX_LINE_BYTES = 1 << 20  # a metrics line longer than this is skipped, never held whole
MAX_CONFIG_BYTES = 4 << 20


def open_regular(path: Path) -> BinaryIO | None:
    """`path` opened for reading when it is a regular file, else None (missing, a FIFO, a device, a folder).

    A runs folder is shared: a FIFO planted in a run directory would block every reader that opens it (open
    waits for a writer). O_NONBLOCK opens without waiting, and fstat of the opened descriptor decides, so a FIFO
    swapped in after a stat() cannot slip through.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except OSError:
        os.close(fd)
        return None


def read_bytes(path: Path, limit: int) -> bytes | None:
    """The bytes of a regular file of at most `limit` bytes; None when it is absent, not regular, or larger."""
    f = open_regular(path)
    if f is None:
        return None
    try:
        with f:
            data = f.read(limit + 1)
    except OSError:
        return None
    return data if len(data) <= limit else None


def read_json(path: Path) -> dict:
    """A JSON object file as a dict; {} when it is missing, unreadable, not regular, too large, not JSON, or not an
    object."""
    data = read_bytes(Path(path), MAX_JSON_BYTES)
    if data is None:
        return {}
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def _lines(f: BinaryIO, limit: int) -> Iterator[bytes]:
    """The lines of a file, each read with a bound: a longer one is skipped (read past in pieces, never whole)."""
    while line := f.readline(limit + 1):
        if len(line) <= limit or line.endswith(b"\n"):
            yield line
            continue
        while (rest := f.readline(limit + 1)) and not rest.endswith(b"\n"):
            pass  # the rest of an over-long line


def read_jsonl(path: Path, tail_bytes: int | None = None) -> list[dict]:
    """The JSON objects of a JSON-lines file (its last `tail_bytes` only, when given); bad or over-long lines are
    skipped; a file that is not regular reads as empty."""
    f = open_regular(Path(path))
    if f is None:
        return []
    records = []
    try:
        with f:
            if tail_bytes is not None:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - tail_bytes))
            for line in _lines(f, MAX_LINE_BYTES):
                if len(line) > MAX_LINE_BYTES:
                    continue
                try:
                    record = json.loads(line)
                except (ValueError, RecursionError):
                    continue  # a tail's first line may be cut, the last one half-written
                if isinstance(record, dict):
                    records.append(record)
    except OSError:
        return records
    return records


def as_int(value, default: int | None = None) -> int | None:
    """An int from a JSON value (bools and non-integral floats are not), else `default`."""
    if isinstance(value, bool):
        return default
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return default


def as_float(value, default: float | None = None) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return default
    return float(value)


def as_str(value, default: str = "") -> str:
    return value if isinstance(value, str) else default


def latest_per_step(records: list[dict], kind: str) -> list[dict]:
    """Records of `kind` with an integer step, each step once: a record written after a resume supersedes the
    earlier one of the same step, and records past a resumed step that a later run superseded are dropped."""
    by_step: dict[int, dict] = {}
    for record in records:
        step = as_int(record.get("step"))
        if record.get("kind") != kind or step is None:
            continue
        # A step lower than one already seen means a resume went back: what followed it before is superseded.
        for later in [s for s in by_step if s > step]:
            del by_step[later]
        by_step[step] = record
    return [by_step[s] for s in sorted(by_step)]


def metrics(run_dir: Path, tail_bytes: int | None = None) -> list[dict]:
    return read_jsonl(Path(run_dir) / METRICS, tail_bytes)


def progress_step(run_dir: Path) -> int | None:
    """The latest finished step that rank 0 reported in progress.json (None: none yet, or unreadable)."""
    return as_int(read_json(Path(run_dir) / PROGRESS).get("step"))


def last_train_record(run_dir: Path) -> dict:
    records = latest_per_step(metrics(run_dir, TAIL_BYTES), "train")
    return records[-1] if records else {}


def launch_record(run_dir: Path) -> dict:
    return read_json(Path(run_dir) / LAUNCH)


def result(run_dir: Path) -> dict | None:
    """result.json's content when the run finished (a damaged one still means it finished), else None."""
    path = Path(run_dir) / RESULT
    try:
        if not path.is_file():
            return None
    except OSError:
        return None
    return read_json(path)  # a regular file: a FIFO put there is not a result


def planned_loss_chunk(run_dir: Path) -> int | None:
    """Tokens per chunk of the chunked loss head on the last pipeline rank (the one holding the head), as the
    launcher's plan counted its memory (plan.json: memory.per_pp_rank[-1].loss_chunk); None when unreadable."""
    ranks = read_json(Path(run_dir) / PLAN).get("memory", {}).get("per_pp_rank")
    if not isinstance(ranks, list) or not ranks or not isinstance(ranks[-1], dict):
        return None
    return as_int(ranks[-1].get("loss_chunk"))


def stop_record(run_dir: Path) -> dict:
    return read_json(Path(run_dir) / STOPPED)


def configured_steps(run_dir: Path) -> int | None:
    """train.steps from config.yaml, read as plain YAML (fast; a damaged config reads as None)."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    data = read_bytes(Path(run_dir) / CONFIG, MAX_CONFIG_BYTES)
    if data is None:
        return None
    try:
        config = yaml.load(data, Loader=loader)  # noqa: S506 (a safe loader; aliases are shared, not expanded)
    except (yaml.YAMLError, ValueError, RecursionError):
        return None
    train = config.get("train") if isinstance(config, dict) else None
    return as_int(train.get("steps")) if isinstance(train, dict) else None


# ---------------------------------------------------------------- writers


def hang_file(run_dir: Path, attempt: str, rank: int) -> Path:
    """Where rank `rank` of worker attempt `attempt` (core/hangs.py names it) keeps its watchdog's stack dump."""
    return Path(run_dir) / HANGS / f"{attempt}.rank{rank}.txt"


def hang_files(run_dir: Path) -> list[Path]:
    """Every hang file of the run, any attempt (sorted by name); [] when there are none or they cannot be listed."""
    try:
        return sorted((Path(run_dir) / HANGS).glob("*.rank*.txt"))
    except OSError:
        return []


def write_json_atomic(path: Path, value: dict) -> None:
    """Write JSON through a temporary file and rename: a reader sees the old or the new file, never half of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(value, indent=2) + "\n")
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def record_stop(run_dir: Path, step: int, signal_name: str, checkpoint: str | None) -> None:
    """The worker's record of a stop on request: the launcher reads it to tell CANCELLED from FAILED."""
    write_json_atomic(Path(run_dir) / STOPPED, {"step": step, "signal": signal_name, "checkpoint": checkpoint,
                                                 "time": time.time(), "host": socket.gethostname()})


def clear_stop(run_dir: Path) -> None:
    """A new attempt starts: an old stop record no longer describes it."""
    with contextlib.suppress(FileNotFoundError):
        (Path(run_dir) / STOPPED).unlink()


# ---------------------------------------------------------------- launch scripts' helper commands


if __name__ == "__main__":
    # Launch scripts (and those of older run directories) call `python -m trainctl.core.rundir hold|refusal|completed`:
    # run trainer_lock as that command. Not an import: trainer_lock builds on this module, never the reverse.
    import runpy

    runpy.run_module("trainctl.core.trainer_lock", run_name="__main__", alter_sys=True)
