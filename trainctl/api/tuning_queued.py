"""`trainctl tune` on a backend that queues its runs (Slurm): the probes as one sweep (launch/sweep.py; on Slurm one
job array), and `tune --collect NAME` that reads what they measured once they ended.

Each probe is checked like a launch first (a refused one is recorded, the others go ahead) and runs with what the
backend adds to every probe (`Backend.probe_overrides`; on Slurm the time limit of --probe-timeout): a hung probe
ends with its job, recorded as failed. The table and the pinned recipe
are written by the collect (the same reading as a local tune's); probes still queued or running are said and left
out, so collecting again later completes the table.
"""

from __future__ import annotations

from pathlib import Path

from trainctl.api.arguments import checked
from trainctl.api.configs import ConfigDirs, resolved
from trainctl.api.tune_table import TUNE_JSON, Probe, TuneResult, finish, merged
from trainctl.core.errors import UserError


def submit_probes(result: TuneResult, probes_overrides: list[tuple[Probe, list[str]]],
                  config_dirs: ConfigDirs) -> None:
    """Check every probe, write their run directories as one sweep under the tune folder and submit it (its
    job and message go on `result`). `probes_overrides`: (Probe, its whole override list) in order."""
    from trainctl.api.launching import launch_problems
    from trainctl.launch import backends, rundir, sweep
    from trainctl.plan import build

    points, submitted = [], []
    for probe, overrides in probes_overrides:
        try:
            cfg = resolved(overrides, config_dirs)
            run_plan = build(cfg)
            problems = launch_problems(cfg, run_plan, dry_run=False, force=False)
        except UserError as exc:
            problems = exc.problems
        if problems:
            probe.status = "refused: " + "; ".join(problems)
            continue
        points.append(sweep.Point(len(points), overrides, cfg, run_plan))
        submitted.append(probe)
    if not points:
        result.message = "every probe was refused: nothing submitted"
        return
    name = f"tune-{result.name}"
    folder = sweep.create(points, name, [], lambda p, run_name: rundir.create(
        p.cfg, p.plan, runs_dir=Path(p.cfg.runs_dir), name=run_name, overrides=p.overrides))
    run_dirs = sweep.point_run_dirs(sweep.read(folder.parent.parent, name))
    for probe, run_dir in zip(submitted, run_dirs, strict=True):
        probe.run_dir, probe.status = str(run_dir), "submitted"
    backend = backends.for_cluster(points[0].cfg.cluster)
    launched = backend.start_sweep(points[0].cfg, name, folder, run_dirs)
    if launched is not None:
        result.job_id = launched.job_id
        runs_dir = result.folder.parent.parent
        result.message = (f"submitted {backend.sweep_label(launched.job_id)} ({len(run_dirs)} probes); when they "
                          f"end: trainctl tune --collect {result.name} --runs-dir {runs_dir}")


@checked
def collect(name: str, runs_dir: Path | str, config_dirs: ConfigDirs = None) -> TuneResult:
    """Re-read a tune's probes (tune.json) and write its table and pinned recipe from what they measured."""
    from trainctl.core import rundir as layout
    from trainctl.core.measured import measured
    from trainctl.launch.rundir import check_name
    from trainctl.runs.registry import run_states

    check_name(name)
    folder = (Path(runs_dir) / "tune" / name).absolute()
    data = layout.read_json(folder / TUNE_JSON)
    if not isinstance(data.get("rows"), list):
        raise UserError([f"--collect {name}: no tune of that name under {Path(runs_dir) / 'tune'}"])
    fields = ("label", "overrides", "predicted_rank", "predicted_tokens_per_s", "predicted_peak_bytes", "run_dir",
              "status")
    probes = [Probe(**{k: row.get(k) for k in fields}) for row in data["rows"]]
    waiting = [p for p in probes if p.run_dir and not p.status.startswith("refused")]
    for probe, state in zip(waiting, run_states([Path(p.run_dir) for p in waiting]), strict=True):
        tokens, peak = measured(Path(probe.run_dir))
        probe.measured_tokens_per_s, probe.measured_peak_bytes = tokens, peak
        if state.active:
            probe.status = f"{state.state.lower()}: not collected yet"
        elif layout.result(Path(probe.run_dir)) is not None and tokens is not None:
            probe.status = "ok"
        else:
            probe.status = f"failed: {state.state}" + (f" ({state.detail})" if state.detail else "")
    result = TuneResult(name, folder, data.get("probe_steps", 0), data.get("candidates", 0), probes,
                        base_overrides=list(data.get("base_overrides") or []), job_id=data.get("job_id", ""))
    return finish(result, lambda p: resolved(merged(result.base_overrides, p.overrides), config_dirs))

