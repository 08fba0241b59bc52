"""Where the numbers go: rank-0 console (rich progress bar or plain lines), metrics.jsonl, W&B.

Every rank logs to `RUN_DIR/logs/rank{R}.log` through python logging (set up by
`__main__`); only rank 0 prints, writes metrics.jsonl and talks to W&B. wandb is
imported only when `logging.wandb.mode` is not disabled: it is slow to import.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import sys
import time
from pathlib import Path

import torch

from trainctl.config.schema import LoggingConfig, PrecisionConfig
from trainctl.core import rundir
from trainctl.core.gpus import match_gpu, peak_flops
from trainctl.train.observe.console import console_line
from trainctl.train.observe.peak_memory import read_prediction, with_prediction
from trainctl.train.observe.scalars import TensorBoard, scalars, tensorboard_available

log = logging.getLogger("trainctl.train")
PROGRESS_INTERVAL_S = 0.5


def print0(message: str, is_main: bool) -> None:
    """The one rank-0 console print; every rank also records the line in its log file."""
    log.info(message)
    if is_main:
        print(message, flush=True)


def device_peak_flops(device: torch.device, precision: PrecisionConfig) -> float | None:
    """Dense peak FLOP/s of one device for MFU, the plan's (core.gpus.peak_flops: the compute dtype's, fp8 runs
    included); None on CPU or an unknown GPU (MFU is then omitted)."""
    if device.type != "cuda":
        return None
    gpu = match_gpu(torch.cuda.get_device_name(device))
    return None if gpu is None else peak_flops(gpu, precision.compute_dtype)


class _Progress:
    """A rich progress bar with ETA, shown only on a TTY."""

    def __init__(self, total_steps: int):
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._bar = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.description}"),
        )
        self._task = self._bar.add_task("", total=total_steps)
        self._bar.start()

    def update(self, step: int, description: str) -> None:
        self._bar.update(self._task, completed=step, description=description)

    def print(self, message: str) -> None:
        self._bar.console.print(message, markup=False, highlight=False)

    def close(self) -> None:
        self._bar.stop()


class MetricsLogger:
    """Sends train/eval/final records to the console, metrics.jsonl and W&B (rank 0)."""

    def __init__(self, run_dir: Path, cfg: LoggingConfig, total_steps: int, is_main: bool, config: dict):
        self.is_main = is_main
        self._total_steps = total_steps
        self._jsonl = None
        self._wandb = None
        self._tensorboard: TensorBoard | None = None
        self._progress = None
        self.wandb_id: str | None = None
        self._run_dir = run_dir
        self._wandb_logged_through = 0  # W&B keeps the steps an earlier attempt logged; see resumed()
        self._progress_written = 0.0
        if not is_main:
            return
        self._jsonl = self._open_jsonl()
        if cfg.progress and sys.stdout.isatty():
            self._progress = _Progress(total_steps)
        if cfg.wandb.mode != "disabled":
            self._wandb = _start_wandb(run_dir, cfg, config)
            self.wandb_id = self._wandb.id
        if cfg.tensorboard and tensorboard_available():
            self._tensorboard = TensorBoard(run_dir)

    def step_done(self, step: int, last: bool = False) -> None:
        """Rank 0: the launcher's progress bar follows every step (progress.json, at most twice a second)."""
        now = time.monotonic()
        if not self.is_main or (now - self._progress_written < PROGRESS_INTERVAL_S and not last):
            return
        self._progress_written = now
        with contextlib.suppress(OSError):  # a full disk must not stop training over a progress bar
            rundir.write_json_atomic(self._run_dir / rundir.PROGRESS, {"step": step})

    def train(self, step: int, values: dict) -> None:
        self._emit({"kind": "train", "step": step, **values}, step)

    def eval(self, step: int, val_loss: float, targets: int | None = None, pairs: dict | None = None) -> None:
        """`targets`: the val tokens the loss averages (0: every one masked, so the loss is nan; said why).
        `pairs`: a preference objective's pair metrics over the held-out pairs, under the train records' names."""
        extra = {"val_targets": targets} if targets is not None else {}
        self._emit({"kind": "eval", "step": step, "val_loss": val_loss, **extra, **(pairs or {})}, step)

    def memory(self, step: int, values: dict) -> None:
        """Measured per-rank memory (memory_stats.memory_record), logged once, next to the plan's prediction."""
        if self.is_main:
            values = with_prediction(values, read_prediction(self._run_dir))
        self._emit({"kind": "memory", "step": step, **values}, step)

    def resumed(self, step: int, path: str, samples_seen: int) -> None:
        """A restart from the checkpoint of `step`: what an earlier attempt logged after it is dropped.

        metrics.jsonl is rewritten without those records, so every reader sees each step once. W&B cannot
        be rewound here (its rewind, `resume_from`, is a server feature in private preview, which a sync
        of an offline run would need too): it keeps the earlier attempt's steps up to the newest it got,
        and only the steps past that are sent to it (W&B would drop lower steps anyway, with a warning each).
        """
        if self.is_main:
            self.step_done(step, last=True)  # an earlier attempt's progress.json may be past the checkpoint
            if self._tensorboard is not None:
                self._tensorboard.resumed(step)
            dropped_through = self._drop_records_after(step)
            self._wandb_logged_through = max(dropped_through, step)
            if dropped_through > step and self._wandb is not None:
                log.warning("W&B keeps this run's earlier values of steps %d..%d (it cannot rewind); "
                            "%s holds the resumed run's", step + 1, dropped_through, rundir.METRICS)
        self._emit({"kind": "resume", "step": step, "checkpoint": path, "samples_seen": samples_seen}, step)

    def checkpoint(self, step: int, values: dict) -> None:
        self._emit({"kind": "checkpoint", "step": step, **values}, step)

    def final(self, summary: dict) -> None:
        self._emit({"kind": "final", **summary}, summary["steps"])

    def _open_jsonl(self):
        return open(self._run_dir / rundir.METRICS, "a", buffering=1)  # line-buffered: tail -f works

    def _drop_records_after(self, step: int) -> int:
        """Rank 0: rewrite metrics.jsonl keeping the records of steps <= `step` and those without a step.

        Through a temporary file and os.replace: a reader sees the old file or the new one, and a crash leaves
        one of them. Unreadable lines (a crash mid-write) go too. Returns the highest step dropped (0: none).
        """
        path = self._run_dir / rundir.METRICS
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        self._jsonl.close()
        highest, dropped = 0, 0
        try:
            with open(path, "rb") as source, open(tmp, "wb") as out:
                for line in source:
                    try:
                        record = json.loads(line)
                    except ValueError:
                        record = None
                    at = rundir.as_int(record.get("step")) if isinstance(record, dict) else None
                    if not isinstance(record, dict) or (at is not None and at > step):
                        dropped += 1
                        highest = max(highest, at or 0)
                        continue
                    out.write(line if line.endswith(b"\n") else line + b"\n")
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
        except FileNotFoundError:
            pass  # nothing logged before: nothing to drop
        finally:
            if tmp.exists():
                tmp.unlink()
            self._jsonl = self._open_jsonl()
        if dropped:
            log.info("%s: dropped %d records past step %d (an earlier attempt's, or unreadable)",
                     rundir.METRICS, dropped, step)
        return highest

    def _emit(self, record: dict, step: int) -> None:
        line = console_line(record, self._total_steps)
        log.info(line)
        if not self.is_main:
            return
        self._jsonl.write(json.dumps(record) + "\n")
        values = scalars(record)
        if self._tensorboard is not None and values and record["kind"] != "final":
            self._tensorboard.log(values, step)
        if self._wandb is not None and step > self._wandb_logged_through and values:
            self._wandb.log(values, step=step)
        if self._progress is None:
            print(line, flush=True)
            return
        if record["kind"] == "train":
            self._progress.update(step, f"loss {record['loss']:.4f}")
        else:
            self._progress.print(line)

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._progress is not None:
            self._progress.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._wandb is not None:
            self._wandb.finish()


def wandb_run_id(run_dir: Path) -> str:
    """The run's W&B id, kept in RUN_DIR/wandb_id: every restart and requeue logs to the same W&B run."""
    path = run_dir / rundir.WANDB_ID
    if path.is_file():
        return path.read_text().strip()
    run_id = secrets.token_hex(4)  # W&B ids: short, [a-z0-9]
    path.write_text(run_id + "\n")
    return run_id


def _start_wandb(run_dir: Path, cfg: LoggingConfig, config: dict):
    import wandb  # lazy: only runs that log to W&B pay for the import

    return wandb.init(
        project=cfg.wandb.project,
        entity=cfg.wandb.entity or None,
        id=wandb_run_id(run_dir),
        resume="allow",
        name=run_dir.name,
        mode=cfg.wandb.mode,
        dir=str(run_dir),  # offline runs land under RUN_DIR/wandb/
        config=config,
    )


class StepTimer:
    """Wall time per logging interval; syncs the device only when asked (at logging steps)."""

    def __init__(self, device: torch.device):
        self._device = device
        self._start = time.perf_counter()
        self._steps = 0

    def tick(self) -> None:
        self._steps += 1

    def lap(self) -> tuple[float, int]:
        """(seconds, steps) since the last lap."""
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        now = time.perf_counter()
        elapsed, steps = now - self._start, self._steps
        self._start, self._steps = now, 0
        return elapsed, steps

    def restart(self) -> None:
        """Drop the time since the last lap (e.g. spent in evaluation) from the next interval."""
        self._start, self._steps = time.perf_counter(), 0
