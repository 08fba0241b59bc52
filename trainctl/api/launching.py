"""Plan, launch and resume one run: check everything first, write the run directory, start it through its backend.

Each step is a function of values: `prepare_launch` / `prepare_resume` check and write (nothing starts), and
`start` starts what they prepared; `launch` and `resume` do both. A caller that shows what was written before the
run's output (the CLI) calls the two steps itself.
"""

from __future__ import annotations

import shlex
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from trainctl.api.arguments import checked
from trainctl.api.configs import ConfigDirs, find_run, override_list, resolved
from trainctl.api.handle import LaunchHandle, OutputTail
from trainctl.config.schema import RunConfig
from trainctl.core import rundir as layout
from trainctl.core.errors import UserError
from trainctl.plan import RunPlan


@dataclass
class Prepared:
    """A run directory written and checked, not started yet."""

    run_dir: Path
    cfg: RunConfig
    plan: RunPlan
    new: bool  # written by this launch (a backend that refuses to start it removes it)
    dry_run: bool = False
    start_command: str = ""  # how to start what a dry run wrote
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    resumes_from: int | None = None  # a resume: the newest committed checkpoint's step (None: the start)
    held: object = field(default=None, repr=False)  # the run's trainer lock, when taken before starting


@checked
def plan(overrides: Sequence[str] | None = None, config_dirs: ConfigDirs = None, *,
         config: RunConfig | None = None) -> RunPlan:
    """The run plan of the config the overrides compose (or of `config`, already resolved)."""
    from trainctl.plan import build

    return build(config if config is not None else resolved(overrides, config_dirs))


@checked
def plan_record(config: RunConfig) -> dict:
    """The plan with the command that would launch it, as the run directory's plan.json will hold it, and its
    calibration against past runs of the same model and layout under runs_dir."""
    from trainctl.launch.command import plan_record as record
    from trainctl.runs.calibration import calibration

    # The plan's error on past measured runs of the same model and layout (issue 26), when there are some.
    found = calibration(config)
    return {**record(plan(config=config), config), **({"calibration": found} if found else {})}


@checked
def compare(config: RunConfig, axis: str) -> list[dict]:
    """Memory and step time along one axis (sharding, checkpointing, tp, micro_batch), one row per choice."""
    from trainctl.plan.compare import compare as rows
    from trainctl.plan.variants import AXES

    if axis not in AXES:
        raise UserError([f"--compare {axis}: not an axis; use one of: {', '.join(AXES)}"])
    return rows(config, axis)


@checked
def launch_problems(cfg: RunConfig, run_plan: RunPlan, dry_run: bool, force: bool,
                    workdir: Path | None = None) -> list[str]:
    """Everything that stops a launch of this config, one line each.

    A dry run is checked the same way (it writes what a launch would start), except that sbatch need not be
    on this machine: the script may be submitted from another one.
    """
    from trainctl.core.support import unsupported
    from trainctl.launch import backends
    from trainctl.launch.preflight import launch_problems as preflight
    from trainctl.plan import refusal

    problems = unsupported(cfg.sharding, cfg.precision)
    too_big = refusal(run_plan)
    if too_big and not force:
        problems.append(too_big)
    if not dry_run:
        problems += backends.for_cluster(cfg.cluster).submit_problems(cfg)
    # cluster.setup syntax, W&B credentials, token files
    return problems + preflight(cfg, workdir=workdir)


def start_command(cfg: RunConfig, script: Path) -> str:
    """How to start what a dry run wrote (sbatch for a Slurm script, bash for a local one)."""
    from trainctl.launch import backends

    return shlex.join(backends.for_cluster(cfg.cluster).start_command(script))


@checked
def prepare_launch(overrides: Sequence[str] | None = None, config_dirs: ConfigDirs = None, *, dry_run: bool = False,
                   force: bool = False, name: str = "", config: RunConfig | None = None) -> Prepared:
    """Check the run and write its directory; nothing starts. `config`: an already resolved config instead."""
    from trainctl.launch import rundir, start_point
    from trainctl.plan import build

    cfg = config if config is not None else resolved(overrides, config_dirs)
    run_plan = build(cfg)
    if problems := launch_problems(cfg, run_plan, dry_run, force) + start_point.source_problems(cfg):
        raise UserError(problems)
    run_dir = rundir.create(cfg, run_plan, runs_dir=Path(cfg.runs_dir), name=name or cfg.name or None,
                            overrides=override_list(overrides))
    command = start_command(cfg, run_dir / layout.SCRIPT) if dry_run else ""
    return Prepared(run_dir, cfg, run_plan, new=True, dry_run=dry_run, start_command=command,
                    warnings=list(run_plan.warnings))


@checked
def prepare_resume(run: str | Path, overrides: Sequence[str] | None = None, *, force: bool = False,
                   runs_dir: Path | str | None = None) -> Prepared:
    """Check a resume of `run` with changed keys and rewrite its config, plan and script (holding its lock when
    the backend runs it here); nothing starts."""
    from trainctl.launch import backends
    from trainctl.launch import resume as resumer
    from trainctl.launch.command import plan_record as record_of
    from trainctl.launch.rundir import script_workdir, write_script
    from trainctl.plan import build

    overrides = override_list(overrides)  # before the run is looked for: a wrong call is the first thing to say
    run_dir = find_run(run, runs_dir)
    _check_idle(run_dir)
    res = resumer.check(run_dir, overrides)
    cfg, workdir = res.resolved, script_workdir(run_dir)
    run_plan = build(cfg)
    if cfg.checkpoint.resume == "never":
        raise UserError([f"run {run_dir.name} has checkpoint.resume=never: it would start over; "
                         "launch a new run instead"])
    if problems := launch_problems(cfg, run_plan, dry_run=False, force=force, workdir=workdir):
        raise UserError(problems)
    # Locally, the lock first: a second resume started at the same moment is refused before it writes anything.
    held = backends.for_cluster(cfg.cluster).lock_before_start(run_dir)
    try:
        record = record_of(run_plan, res.cfg, run_dir)
        record.update(workdir=str(workdir or Path.cwd()), notes=[*record["notes"], *res.notes],
                      warnings=[*record["warnings"], *res.warnings])
        resumer.apply(res, record)
        # The script for where the run is now (it may have been copied or moved), launched from where it was.
        write_script(run_dir, res.cfg, run_dir, workdir or Path.cwd())
    except BaseException:
        if held is not None:
            held.release()  # nothing was launched: the next resume must not find the run locked
        raise
    return Prepared(run_dir, cfg, run_plan, new=False, notes=list(res.notes), warnings=list(res.warnings),
                    resumes_from=res.step, held=held)


def _check_idle(run_dir: Path) -> None:
    """A UserError when the run is active, or its state cannot be known now (before anything is written)."""
    from trainctl.runs import registry as runs

    state = runs.run_state(run_dir)
    if state.active:
        raise UserError([f"run {state.name} is still {state.state} ({state.detail}); "
                         f"wait for it, or `trainctl cancel {state.name}` first"])
    if state.maybe_active:
        raise UserError([f"run {state.name}: {state.detail}; its job may still be running, "
                         "so try again when it answers"])


@checked
def start(prepared: Prepared, *, wait: bool = True, on_output: Callable[[bytes], None] | None = None,
          console: bool = False) -> LaunchHandle:
    """Start a prepared run through its backend.

    `wait`: a run here runs to its end first; without, it runs in a background thread. Its console output goes to
    `on_output` and the handle's `output` keeps its tail; `console` (the CLI's): to this process's terminal instead,
    with a progress bar and the failure line on stderr. A queued run returns at once.
    """
    from trainctl.launch import backends

    if prepared.dry_run:
        raise UserError([f"{prepared.run_dir}: written by a dry run; start it with {prepared.start_command}"])
    backend = backends.for_cluster(prepared.cfg.cluster)
    sink = None if console and wait else OutputTail(on_output)
    held = prepared.held
    if not wait and held is None:
        # Taken here, not in the thread: the run reads as RUNNING from the moment this returns.
        held = backend.lock_before_start(prepared.run_dir)
    handle = LaunchHandle(prepared.run_dir, backend.name, output=sink)
    if wait or held is None:  # a backend that queues the run (its job takes the lock) returns at once
        _started(handle, backend, prepared, held, sink)
        return handle
    handle._thread = threading.Thread(target=_started, args=(handle, backend, prepared, held, sink),
                                      name=f"trainctl {handle.name}", daemon=True)
    handle._thread.start()
    return handle


def _started(handle: LaunchHandle, backend, prepared: Prepared, held, sink: OutputTail | None) -> None:
    """Start through the backend and record what it did on the handle (in a thread: its error too)."""
    extra = {"out": sink} if sink is not None else {}  # a backend that runs nothing here has no output to take
    try:
        launched = backend.start(prepared.run_dir, prepared.cfg, new=prepared.new, held=held, **extra)
    except BaseException as exc:
        if handle._thread is None:
            raise
        handle._error = exc
        return
    handle.job_id, handle.message, handle.exit_code = launched.job_id, launched.message, launched.exit_code


@checked
def launch(overrides: Sequence[str] | None = None, config_dirs: ConfigDirs = None, *, dry_run: bool = False,
           force: bool = False, name: str = "", config: RunConfig | None = None, wait: bool = True,
           on_output: Callable[[bytes], None] | None = None) -> LaunchHandle:
    """Check, write and start one run (see `prepare_launch` and `start`); a dry run writes and starts nothing."""
    prepared = prepare_launch(overrides, config_dirs, dry_run=dry_run, force=force, name=name, config=config)
    if dry_run:
        return LaunchHandle(prepared.run_dir, _backend_name(prepared.cfg), message=prepared.start_command)
    return start(prepared, wait=wait, on_output=on_output)


@checked
def resume(run: str | Path, overrides: Sequence[str] | None = None, *, force: bool = False,
           runs_dir: Path | str | None = None, wait: bool = True,
           on_output: Callable[[bytes], None] | None = None) -> LaunchHandle:
    """Continue a run from its newest committed checkpoint, with its own config or changed keys (see `start`)."""
    return start(prepare_resume(run, overrides, force=force, runs_dir=runs_dir), wait=wait, on_output=on_output)


def _backend_name(cfg: RunConfig) -> str:
    from trainctl.launch import backends

    return backends.for_cluster(cfg.cluster).name
