"""The launcher backend interface: everything trainctl asks of "where the workers run".

A backend renders the run's launch script, checks what only it can check before anything is written,
starts a run (here, or by submitting it to a scheduler), starts sweeps and tune's probes, and later reads the
state of its runs, names their logs and cancels them. Each backend is one folder,
launch/backends/<kind>/, holding all of itself; nothing outside it imports its modules or compares its name: the
CLI, the api, the run directory and `trainctl runs` ask the backend the run's `cluster.launcher` names
(`backends.for_cluster`, `backends.for_record`). Its typed config (`config.schema.ClusterConfig` and its
subclasses, in config/ since composing is below launch) answers what plan/ and config/ need.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, ClassVar, NamedTuple

from trainctl.config.schema import ClusterConfig, RunConfig


class State(NamedTuple):
    """One run's state as its backend tells it (a plain (state, active, detail) tuple reads as one too)."""

    state: str  # NOT_STARTED, PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, ... (Slurm's names), UNKNOWN
    active: bool
    detail: str
    maybe_active: bool = False  # the backend could not be asked now: the run may still be running


StateTuple = tuple[str, bool, str] | State


@dataclass(frozen=True)
class Launched:
    """What starting a run (or a sweep) did: an exit code when it ran here, else the job it queued."""

    exit_code: int | None = None  # the run's exit code when it ran to its end in this process; None: queued
    job_id: str = ""
    message: str = ""  # one line for the user (how to follow it), plain text


class Backend(ABC):
    """One way of running workers. Subclasses set `name` (the `cluster.launcher` value) and implement the rest."""

    name: ClassVar[str]

    # ---- before a run directory is written

    def preflight(self, cfg: RunConfig, *, dry_run: bool, machine=None) -> list[str]:
        """Problems that would stop the run after it started, only this backend can see; one line each."""
        return []

    def submit_problems(self, cfg: RunConfig) -> list[str]:
        """What starting (not a dry run) needs on this machine, e.g. the scheduler's client."""
        return []

    # ---- the run directory's launch script and command

    @abstractmethod
    def render(self, cfg: RunConfig, run_dir: Path, workdir: Path) -> str:
        """The text of RUN_DIR/launch.sh."""

    @abstractmethod
    def argv(self, cluster: ClusterConfig, run_dir: Path) -> list[str]:
        """The command that starts the workers, as plan.json records it."""

    @abstractmethod
    def start_command(self, script: Path) -> list[str]:
        """How a user starts a script a dry run wrote."""

    # ---- starting

    def lock_before_start(self, run_dir: Path):
        """A trainer lock the launcher must take before rewriting a run's files (None: the job takes it itself)."""
        return None

    @abstractmethod
    def start(self, run_dir: Path, cfg: RunConfig, *, new: bool, held=None, out: BinaryIO | None = None) -> Launched:
        """Start the run in `run_dir`. `new`: this command wrote it (a refusal removes it); `held`: its lock;
        `out`: where a run started here writes its console output (default: this process's stdout)."""

    def sweep_problems(self, cfgs: list[RunConfig]) -> list[str]:
        return []

    def write_sweep(self, cfg: RunConfig, name: str, folder: Path, run_dirs: list[Path]) -> Path | None:
        """A script that starts the whole sweep (a dry run leaves it to start), or None: points start one by one."""
        return None

    def start_sweep(self, cfg: RunConfig, name: str, folder: Path, run_dirs: list[Path]) -> Launched | None:
        """Start every point at once, or None: the caller starts the points one after another with `start`."""
        return None

    def sweep_label(self, job_id: str) -> str:
        """How messages name the one job `start_sweep` queued for all the points."""
        return f"the {self.name} sweep {job_id}"

    # ---- tune's probes (api/tuning.py): run here one after another, or queued as one sweep

    queues_probes: ClassVar[bool] = False  # True: tune submits its probes with `start_sweep`, collected later

    def probe_overrides(self, timeout_s: float) -> list[str]:
        """Overrides every tune probe gets, e.g. a job time limit, so that a hung queued probe ends by itself."""
        return []

    # ---- watching and stopping

    @abstractmethod
    def states(self, records: dict[Path, dict]) -> dict[Path, StateTuple]:
        """The state of each run this backend launched (its launch.json record given), in one query if it can."""

    @abstractmethod
    def log_path(self, run_dir: Path, record: dict) -> Path:
        """The log `trainctl logs` shows when no rank is named."""

    def job_label(self, job_id: str) -> str:
        """How messages name a run's job."""
        return f"the {self.name} launch"

    @abstractmethod
    def cancel(self, run_dir: Path, job_id: str) -> None:
        """Ask an active run to stop (it checkpoints first)."""

    def holder_job(self, holder: dict) -> str:
        """The job of this backend a trainer lock's holder (trainer.json) records, "" if none: a launch script of
        a dry run started by hand still gets cancelled through the backend that runs it."""
        return ""
