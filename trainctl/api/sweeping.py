"""A sweep: one run per point of Hydra's sweep grammar, every point checked before anything is written."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from trainctl.api.arguments import checked
from trainctl.api.configs import ConfigDirs, override_list, search
from trainctl.api.launching import launch_problems, start_command
from trainctl.core.errors import UserError


@dataclass
class PreparedSweep:
    """A sweep's run directories written and checked, nothing started."""

    name: str
    folder: Path
    points: list  # launch.sweep.Point: index, overrides, cfg, plan
    run_dirs: list[Path]
    varied: list[list[str]]  # per point, the overrides that differ between points
    dry_run: bool = False
    start_command: str = ""  # a dry run of a backend that starts the whole sweep at once: how to submit it


@dataclass
class SweepResult:
    """What starting a sweep did: a queued job array (job_id, message), or the points run here one by one."""

    name: str
    run_dirs: list[Path]
    job_id: str = ""
    message: str = ""
    exit_codes: list[int] = field(default_factory=list)  # the points run here, in order
    stopped_at: int | None = None  # the point a stop request ended the sweep at

    @property
    def exit_code(self) -> int:
        """The first failed point's exit code, else 0."""
        return next((c for c in self.exit_codes if c), 0)


@checked
def prepare_sweep(overrides: Sequence[str], config_dirs: ConfigDirs = None, *, dry_run: bool = False,
                  force: bool = False, name: str = "") -> PreparedSweep:
    """Every point checked first (nothing is written if one is bad), then the run directories."""
    from trainctl.config import compose as composer
    from trainctl.config import sources
    from trainctl.config.validate import resolve
    from trainctl.launch import backends, rundir, sweep
    from trainctl.plan import build

    sp, overrides = search(config_dirs), override_list(overrides)

    def build_point(point: list[str]):
        cfg = resolve(composer.compose(point, sp))
        run_plan = build(cfg)
        return cfg, run_plan, launch_problems(cfg, run_plan, dry_run, force)

    points = sweep.check_points(sweep.expand(overrides, lambda group: list(sources.options(group, sp))), build_point)
    if problems := sweep.duplicate_problems(points):
        raise UserError(problems)
    launchers = {p.cfg.cluster.launcher for p in points}
    if len(launchers) > 1:
        raise UserError([f"-m: the points use different launchers ({', '.join(sorted(launchers))}); sweep one"])
    backend = backends.for_cluster(points[0].cfg.cluster)
    if problems := backend.sweep_problems([p.cfg for p in points]):
        raise UserError(problems)
    sweep_name = name or sweep.default_name(points[0].cfg)
    folder = sweep.create(points, sweep_name, overrides, lambda p, run_name: rundir.create(
        p.cfg, p.plan, runs_dir=Path(p.cfg.runs_dir), name=run_name, overrides=p.overrides))
    run_dirs = sweep.point_run_dirs(sweep.read(folder.parent.parent, sweep_name))
    prepared = PreparedSweep(sweep_name, folder, points, run_dirs, sweep.swept([p.overrides for p in points]),
                             dry_run=dry_run)
    if dry_run:
        script = backend.write_sweep(points[0].cfg, sweep_name, folder, run_dirs)
        prepared.start_command = start_command(points[0].cfg, script) if script is not None else ""
    return prepared


@checked
def start_sweep(prepared: PreparedSweep, *, on_point: Callable[[object, int], None] | None = None,
                on_output: Callable[[bytes], None] | None = None, console: bool = False) -> SweepResult:
    """Start the whole sweep through its backend (one job array on Slurm), or run the points here one after another:
    `on_point(point, total)` before each; a stop request (its checkpoint saved) ends the sweep. The points' output
    goes to `on_output` (`console`: to this process's terminal, as `api.start` says)."""
    from trainctl.api.handle import OutputTail
    from trainctl.core import rundir as layout
    from trainctl.launch import backends

    cfg = prepared.points[0].cfg
    result = SweepResult(prepared.name, prepared.run_dirs)
    launched = backends.for_cluster(cfg.cluster).start_sweep(cfg, prepared.name, prepared.folder, prepared.run_dirs)
    if launched is not None:
        result.job_id, result.message = launched.job_id, launched.message
        return result
    extra = {} if console else {"out": OutputTail(on_output)}
    for point, run_dir in zip(prepared.points, prepared.run_dirs, strict=True):
        if on_point is not None:
            on_point(point, len(prepared.points))
        backend = backends.for_cluster(point.cfg.cluster)
        result.exit_codes.append(backend.start(run_dir, point.cfg, new=False, **extra).exit_code or 0)
        if layout.stop_record(run_dir):
            result.stopped_at = point.index
            break
    return result


@checked
def sweep(overrides: Sequence[str], config_dirs: ConfigDirs = None, *, force: bool = False, name: str = "",
          on_output: Callable[[bytes], None] | None = None) -> SweepResult:
    """Check, write and start a sweep (see `prepare_sweep` and `start_sweep`)."""
    return start_sweep(prepare_sweep(overrides, config_dirs, force=force, name=name), on_output=on_output)
