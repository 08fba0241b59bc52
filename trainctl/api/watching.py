"""Runs after launch, as values: their states and figures, one run's status, a sweep's ranking; cancel, logs, plot."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from trainctl.api.arguments import checked
from trainctl.api.configs import ConfigDirs, env_runs_dir, find_run, runs_dir_of
from trainctl.core.errors import UserError
from trainctl.runs.figures import Figures
from trainctl.runs.registry import RunState


@dataclass(frozen=True)
class RunInfo:
    """One run: its state (`state.state`, `state.active`, ...) and its measured figures."""

    state: RunState
    figures: Figures
    eta_s: float | None = None  # an active run's time left at its recent pace (`status` only)
    log: Path | None = None  # the log `trainctl logs` shows (`status` only)

    @property
    def name(self) -> str:
        return self.state.name

    @property
    def done(self) -> bool:
        """Ended or never started: nothing runs now (a finished, failed or cancelled run, or a dry run's)."""
        return not self.state.active

    def to_dict(self) -> dict:
        """The run's record as `trainctl runs --json` and `status --json` print it (None where not known)."""
        st = self.state
        return {"name": st.name, "path": str(Path(st.path).resolve()), "launcher": st.launcher, "job_id": st.job_id,
                "state": st.state, "active": st.active, "detail": st.detail, "step": st.step, "steps": st.steps,
                **self.figures.as_dict(), **({"eta_s": self.eta_s} if self.eta_s is not None else {}),
                **({"log": str(self.log)} if self.log is not None else {})}


@checked
def runs(runs_dir: Path | str | None = None, overrides: Sequence[str] | None = None,
         config_dirs: ConfigDirs = None) -> list[RunInfo]:
    """Every run under runs_dir (default: the config's runs_dir, $TRAINCTL_RUNS_DIR, else runs/), oldest first."""
    from trainctl.runs import registry as found
    from trainctl.runs.figures import figures

    states = found.run_states(found.list_runs(runs_dir_of(runs_dir, overrides, config_dirs)))
    return [RunInfo(st, figures(st.path)) for st in states]


@checked
def status(run: str | Path, runs_dir: Path | str | None = None) -> RunInfo:
    """One run's state, figures, ETA (while active) and log path; `run` is a path or a name under runs_dir."""
    from trainctl.runs import registry as found
    from trainctl.runs.figures import figures

    run_dir = find_run(run, runs_dir)
    st, f = found.run_state(run_dir), figures(run_dir)
    return RunInfo(st, f, f.eta_s(st.step, st.steps) if st.active else None, found.log_path(run_dir, None))


@dataclass(frozen=True)
class Cancelled:
    state: RunState  # the run's state before the cancel
    what: str  # how messages name its job: "the local launch", "Slurm job 123"


@checked
def cancel(run: str | Path, runs_dir: Path | str | None = None) -> Cancelled:
    """Stop a running or pending run (it checkpoints first; scancel on Slurm)."""
    from trainctl.launch import backends
    from trainctl.runs import registry as found

    st = found.cancel(find_run(run, runs_dir))
    return Cancelled(st, backends.named(st.launcher).job_label(st.job_id))


@dataclass(frozen=True)
class SweepRanking:
    name: str
    metric: str  # val_loss (every finished point has one) or loss
    rows: list[dict]  # run, state, finished, train_loss, val_loss, swept, ...; best first, unfinished last


@checked
def sweep_runs(name: str, runs_dir: Path | str | None = None) -> SweepRanking:
    """A sweep's points ranked by their final eval loss (else train loss), finished points first."""
    from trainctl.launch import sweep
    from trainctl.runs import registry as found

    record = sweep.read(Path(runs_dir) if runs_dir is not None else env_runs_dir(), name)
    dirs = sweep.point_run_dirs(record)
    states = {str(d): st.state for d, st in zip(dirs, found.run_states(dirs), strict=True)}
    metric, rows = sweep.ranked(record, states)
    return SweepRanking(name, metric, rows)


@checked
def logs(run: str | Path, out: BinaryIO, *, rank: int | None = None, follow: bool = False,
         runs_dir: Path | str | None = None) -> None:
    """Copy a run's log (a rank's own, else its workers' newest output) to `out`; `follow`: until the run ends."""
    from trainctl.core import rundir as layout
    from trainctl.runs import registry as found

    run_dir = find_run(run, runs_dir)
    if rank is not None and rank < 0:
        raise UserError([f"--rank {rank}: ranks count from 0"])
    state = found.run_state(run_dir)
    path = found.log_path(run_dir, rank)
    if not follow or not state.active:
        # A run that is not active will write no log: say what there is instead of waiting or printing nothing.
        f = layout.open_regular(path)
        if f is None:
            raise UserError([_no_log(path, rank, state.state, run_dir)])
        with f:
            while chunk := f.read(found.FOLLOW_CHUNK):
                out.write(chunk)
        return
    if not found.follow(lambda: found.log_path(run_dir, rank), lambda: found.run_state(run_dir).active, out):
        raise UserError([_no_log(path, rank, found.run_state(run_dir).state, run_dir)])


def _no_log(path: Path, rank: int | None, state: str, run_dir: Path) -> str:
    if path.exists() and not path.is_file():
        return f"{path} is not a regular file (something else was put there); it is not read"
    if rank is not None:
        ranks = sorted(p.name for p in (run_dir / "logs").glob("rank*.log"))
        have = f"; logs there: {', '.join(ranks)}" if ranks else ""
        return f"--rank {rank}: {path} does not exist (run state {state}){have}"
    return f"{path} does not exist (run state {state}); a run writes it once its workers start"


@checked
def plot(runs: Sequence[str | Path] = (), *, sweep_name: str | None = None, out_file: Path | str | None = None,
         runs_dir: Path | str | None = None) -> Path:
    """Draw train/eval loss, learning rate, tokens/s and grad norm of runs (or a sweep's points) overlaid; the PNG."""
    from trainctl.launch import sweep
    from trainctl.runs import registry as found
    from trainctl.runs.plot import plot as draw
    from trainctl.runs.plot import target_path

    where = Path(runs_dir) if runs_dir is not None else env_runs_dir()
    run_dirs = [found.find_run(str(r), where) for r in runs]
    labels = [d.name for d in run_dirs]
    if sweep_name is not None:
        record = sweep.read(where, sweep_name)
        run_dirs += sweep.point_run_dirs(record)
        # A sweep's curves are told apart by what the sweep varies.
        labels += [f"{p['run_dir'].rsplit('/', 1)[-1]}: {' '.join(varied)}" for p, varied in
                   zip(record["points"], sweep.swept([p.get("overrides", []) for p in record["points"]]), strict=True)]
    if not run_dirs:
        raise UserError(["plot: name runs (trainctl plot RUN [RUN...]) or a sweep (--sweep NAME)"])
    default = sweep.sweep_dir(where, sweep_name) / "plot.png" if sweep_name else (
        run_dirs[0] / "plot.png" if len(run_dirs) == 1 else Path("plot.png"))
    target = target_path(Path(out_file) if out_file is not None else default)  # checked before anything is drawn
    return draw(run_dirs, target, labels)
