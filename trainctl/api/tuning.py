"""`trainctl tune`: rank the layouts the plan says fit (plan/tune.py), probe the top K with short runs, and pin the
fastest measured one as a recipe file that launches as is.

The probes run here one after another, each a normal run directory under RUNS_DIR/tune/NAME/ (so `trainctl
status`, `logs` and `runs --runs-dir` read them): train.steps=N without eval, with a log line every step and no
final checkpoint. A probe that is refused, fails (an out-of-memory error, a crash) or outlives its timeout (a hang:
it is cancelled) is recorded as failed with why; the tune goes on. What a probe measured is read from what its
rank 0 wrote (trainctl/core/measured.py). A backend that queues its runs (Slurm) gets the probes as one sweep
instead, collected once they ended (tuning_queued.py); the table and the pinned recipe are tune_table.py's.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from trainctl.api import tuning_queued
from trainctl.api.arguments import checked
from trainctl.api.configs import ConfigDirs, override_list, resolved, search
from trainctl.api.tune_table import TUNE_JSON, Probe, TuneResult, finish, merged, pin, write
from trainctl.config.schema import RunConfig
from trainctl.core.errors import UserError
from trainctl.core.measured import measured

__all__ = ["CANCEL_GRACE_S", "DEFAULT_PROBE_STEPS", "DEFAULT_REPEATS", "DEFAULT_PROBE_TIMEOUT_S", "DEFAULT_TOP",
           "TUNE_JSON", "Probe", "TuneInterrupted", "TuneResult", "finish", "merged", "pin", "probe_overrides", "tune",
           "write"]

DEFAULT_TOP = 4
DEFAULT_REPEATS = 2  # a shared machine's speed swings between runs: one probe alone cannot tell noise from a win
DEFAULT_PROBE_STEPS = 20
DEFAULT_PROBE_TIMEOUT_S = 600.0
CANCEL_GRACE_S = 60.0  # a cancelled probe's time to checkpoint-free exit before it is left behind


class TuneInterrupted(KeyboardInterrupt):
    """Ctrl-C during a local tune: the running probe was stopped and the finished probes' table written."""

    def __init__(self, result: TuneResult):
        super().__init__(f"tune {result.name} interrupted")
        self.result = result


def probe_overrides(warmup_steps: int, steps: int) -> list[str]:
    """A short run that measures speed and memory only (warmup kept below the steps, as validate wants)."""
    return [f"train.steps={steps}", f"schedule.warmup_steps={min(warmup_steps, steps // 2)}", "train.eval_every=0",
            "logging.log_every=1", "checkpoint.every=0", "checkpoint.save_final=false"]


def _run_probe(probe: Probe, overrides: list[str], config_dirs: ConfigDirs, name: str, timeout_s: float,
               on_output: Callable[[bytes], None] | None) -> None:
    """Launch one probe here and wait for it (cancelled past `timeout_s`); its outcome goes on `probe`."""
    from trainctl.api.launching import prepare_launch, start
    from trainctl.api.watching import cancel

    try:
        prepared = prepare_launch(overrides, config_dirs, name=name)
    except UserError as exc:
        probe.status = "refused: " + "; ".join(exc.problems)
        return
    probe.run_dir = str(prepared.run_dir)
    handle = start(prepared, wait=False, on_output=on_output)
    try:
        code = handle.wait(timeout_s)
    except KeyboardInterrupt:  # the probe runs in its own process group: stop it, or it trains on without us
        _stop(prepared.run_dir, handle, cancel)
        probe.status = "interrupted"
        raise
    if not handle.done:
        _stop(prepared.run_dir, handle, cancel)
        probe.status = f"timed out after {timeout_s:.0f} s"
        return
    tokens, peak = measured(prepared.run_dir)
    probe.measured_tokens_per_s, probe.measured_peak_bytes = tokens, peak
    if code:
        probe.status = f"failed: exit {code}" + (f" ({handle.report})" if handle.report else "")
    elif tokens is None:
        probe.status = "failed: no step was measured"
    else:
        probe.status = "ok"


def _run_repeats(probe: Probe, repeats: int, overrides: list[str], config_dirs: ConfigDirs, name: str,
                 timeout_s: float, on_output: Callable[[bytes], None] | None) -> None:
    """Probe one layout `repeats` times (stopping at a failure): its speed is their median, its peak their largest,
    each repeat's speed kept for the table's spread."""
    speeds, peaks = [], []
    for k in range(repeats):
        _run_probe(probe, overrides, config_dirs, name if k == 0 else f"{name}-r{k + 1}", timeout_s, on_output)
        if not probe.ok:
            probe.status += f" (repeat {k + 1} of {repeats})" if repeats > 1 else ""
            return
        speeds.append(probe.measured_tokens_per_s)
        peaks += [probe.measured_peak_bytes] if probe.measured_peak_bytes is not None else []
    probe.repeats = speeds
    probe.measured_tokens_per_s = statistics.median(speeds)
    probe.measured_peak_bytes = max(peaks) if peaks else None


def _stop(run_dir: Path, handle, cancel) -> None:
    """Ask the probe's workers to stop (as `trainctl cancel` does) and give them CANCEL_GRACE_S to leave."""
    try:
        cancel(run_dir)
    except UserError:
        pass  # it ended between the wait and the cancel
    try:
        handle.wait(CANCEL_GRACE_S)
    except KeyboardInterrupt:  # a second Ctrl-C: once more, now (the stop signal's second use kills at once)
        try:
            cancel(run_dir)
        except UserError:
            pass
        handle.wait(CANCEL_GRACE_S)


def _start(overrides: list[str], config_dirs: ConfigDirs) -> tuple[list[str], RunConfig, list[str]]:
    """(the overrides, the config tune starts from, what it filled in): a start whose layout does not suit its
    cluster gets the degrees, micro-batch and grad_accum tune derives (plan/tune.start_fills); else refused as
    launch would refuse it."""
    from trainctl.config import compose as composer
    from trainctl.plan import tune as planner

    try:
        return overrides, resolved(overrides, config_dirs), []
    except UserError as refused:
        try:
            fills = planner.start_fills(composer.compose(overrides, search(config_dirs)))
            if not fills:
                raise
            both = merged(overrides, fills)
            return both, resolved(both, config_dirs), fills
        except UserError:
            raise refused from None



@checked
def tune(overrides: Sequence[str] | None = None, config_dirs: ConfigDirs = None, *, top: int = DEFAULT_TOP,
         probe_steps: int = DEFAULT_PROBE_STEPS, probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S, name: str = "",
         repeats: int = DEFAULT_REPEATS, on_probe: Callable[[Probe, int, int], None] | None = None,
         on_start: Callable[[TuneResult], None] | None = None,
         on_output: Callable[[bytes], None] | None = None) -> TuneResult:
    """Rank, probe the top `top` here one after another (`on_probe(probe, i, total)` before each), write the table
    (NAME/tune.json) and the winner's pinned recipe. A backend that queues its runs: submit the probes as one sweep
    and return (the table comes from `tuning_queued.collect` once they ended)."""
    from trainctl.launch import backends
    from trainctl.launch.rundir import check_name
    from trainctl.plan import tune as planner

    if top < 1 or probe_steps < 2:
        raise UserError([f"--top {top} --probe-steps {probe_steps}: probe at least 1 layout for at least 2 steps"])
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise UserError([f"--repeats {repeats}: probe each layout at least once (default {DEFAULT_REPEATS})"])
    if not probe_timeout_s > 0:  # also NaN
        raise UserError([f"--probe-timeout {probe_timeout_s:g}: give the seconds before a probe counts as hung (> 0)"])
    overrides, cfg, filled = _start(override_list(overrides), config_dirs)
    ranked = planner.rank(cfg)
    if not ranked:
        raise UserError(["no layout fits this cluster; see `trainctl plan` for the memory breakdown"])
    name = name or f"{Path(cfg.recipe).stem or cfg.model.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    check_name(name)  # one plain directory name under RUNS_DIR/tune
    folder = (Path(cfg.runs_dir) / "tune" / name).absolute()  # the pinned recipe is named from anywhere
    if folder.exists():
        raise UserError([f"--name {name}: {folder} already exists; pick another name"])
    folder.mkdir(parents=True)
    result = TuneResult(name, folder, probe_steps, len(ranked), base_overrides=overrides, filled=filled,
                        repeats=repeats)
    short = probe_overrides(cfg.schedule.warmup_steps, probe_steps) + [f"runs_dir={folder}"]
    probes = [Probe(c.label, list(c.overrides), i + 1, c.predicted_tokens_per_s, c.peak_bytes)
              for i, c in enumerate(ranked[:top])]
    result.probes = probes
    if on_start is not None:
        on_start(result)  # e.g. say what was filled in, before the first probe
    backend = backends.for_cluster(cfg.cluster)
    short += backend.probe_overrides(probe_timeout_s)  # e.g. a job time limit: a hung queued probe ends by itself
    if backend.queues_probes:
        result.repeats = 1  # one job per probe in the array: its repeats would queue as separate jobs
        tuning_queued.submit_probes(result, [(p, merged(overrides, p.overrides, short)) for p in probes], config_dirs)
        if repeats > 1 and result.job_id:
            result.message += f"; queued probes run once each (--repeats {repeats} applies to a local tune)"
        write(result)
        return result
    from trainctl.launch.sweep import terminate_as_interrupt

    try:
        with terminate_as_interrupt():  # SIGTERM/SIGHUP as Ctrl-C: the running probe is stopped, not orphaned
            for i, probe in enumerate(probes):
                if on_probe is not None:
                    on_probe(probe, i, len(probes))
                _run_repeats(probe, repeats, merged(overrides, probe.overrides, short), config_dirs,
                             f"probe-{i + 1:02d}", probe_timeout_s, on_output)
    except KeyboardInterrupt:
        result.interrupted = True  # the table of what finished, but no pinned recipe: the race was not run out
        finish(result, lambda p: ranked[p.predicted_rank - 1].cfg)
        raise TuneInterrupted(result) from None
    return finish(result, lambda p: ranked[p.predicted_rank - 1].cfg)


