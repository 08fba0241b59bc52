"""`trainctl tune`: rank the layouts the plan says fit (plan/tune.py), probe the top K with short runs, and pin the
fastest measured one as a recipe file that launches as is.

The probes run here one after another, each a normal run directory under RUNS_DIR/tune/NAME/ (so `trainctl
status`, `logs` and `runs --runs-dir` read them): train.steps=N without eval, with a log line every step and no
final checkpoint. A probe that is refused, fails (an out-of-memory error, a crash) or outlives its timeout (a hang:
it is cancelled) is recorded as failed with why; the tune goes on. What a probe measured is read from what its
rank 0 wrote (trainctl/core/measured.py). On Slurm the probes are one job array instead (tuning_slurm.py).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from trainctl.api.configs import ConfigDirs, override_list, resolved
from trainctl.core.errors import UserError
from trainctl.core.measured import error, measured

TUNE_JSON = "tune.json"
DEFAULT_TOP = 4
DEFAULT_PROBE_STEPS = 20
DEFAULT_PROBE_TIMEOUT_S = 600.0
CANCEL_GRACE_S = 60.0  # a cancelled probe's time to checkpoint-free exit before it is left behind


@dataclass
class Probe:
    """One probed layout: the plan's prediction and what its short run measured."""

    label: str
    overrides: list[str]
    predicted_rank: int  # 1: the plan's fastest
    predicted_tokens_per_s: float | None
    predicted_peak_bytes: int
    run_dir: str = ""
    status: str = "not run"  # ok | failed: why | timed out | refused: why
    measured_tokens_per_s: float | None = None
    measured_peak_bytes: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def tokens_error(self) -> float | None:
        """measured / predicted - 1 (+0.10: 10% faster than predicted)."""
        return error(self.measured_tokens_per_s, self.predicted_tokens_per_s)

    @property
    def peak_error(self) -> float | None:
        return error(self.measured_peak_bytes, self.predicted_peak_bytes)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "tokens_error": self.tokens_error, "peak_error": self.peak_error}


@dataclass
class TuneResult:
    name: str
    folder: Path
    probe_steps: int
    candidates: int  # the layouts that fit, of which the top were probed
    probes: list[Probe] = field(default_factory=list)  # sorted by measured tokens/s, failed ones last
    recipe_file: Path | None = None  # the pinned recipe of the winner (None: every probe failed)
    base_overrides: list[str] = field(default_factory=list)  # the user's (a collect composes the winner from them)
    job_id: str = ""  # Slurm: the probes' job array
    message: str = ""  # Slurm: what the submission said
    interrupted: bool = False  # Ctrl-C (or SIGTERM) ended the tune: the table holds the probes that finished

    @property
    def winner(self) -> Probe | None:
        return next((p for p in self.probes if p.ok), None)

    @property
    def launch_command(self) -> str:
        return "" if self.recipe_file is None else f"trainctl launch recipe={self.recipe_file}"

    def to_dict(self) -> dict:
        return {"name": self.name, "folder": str(self.folder), "probe_steps": self.probe_steps,
                "candidates": self.candidates, "rows": [p.to_dict() for p in self.probes],
                "winner": None if self.winner is None else self.winner.label,
                "recipe_file": None if self.recipe_file is None else str(self.recipe_file),
                "launch": self.launch_command, "base_overrides": self.base_overrides, "job_id": self.job_id,
                "interrupted": self.interrupted}


class TuneInterrupted(KeyboardInterrupt):
    """Ctrl-C during a local tune: the running probe was stopped and the finished probes' table written."""

    def __init__(self, result: TuneResult):
        super().__init__(f"tune {result.name} interrupted")
        self.result = result


def probe_overrides(warmup_steps: int, steps: int) -> list[str]:
    """A short run that measures speed and memory only (warmup kept below the steps, as validate wants)."""
    return [f"train.steps={steps}", f"schedule.warmup_steps={min(warmup_steps, steps // 2)}", "train.eval_every=0",
            "logging.log_every=1", "checkpoint.every=0", "checkpoint.save_final=false"]


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def merged(base: Sequence[str], *later: Sequence[str]) -> list[str]:
    """`base` without the keys a later list sets (Hydra refuses one key twice), then the later lists."""
    taken = {_key(o) for group in later for o in group}
    return [o for o in base if _key(o) not in taken] + [o for group in later for o in group]


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


def pin(cfg, folder: Path, label: str) -> Path:
    """The winner's whole config as a recipe file (`recipe=PATH` launches it as is)."""
    from trainctl.config.load import to_yaml

    base = cfg.recipe or cfg.model.name or "run"
    recipe = f"{Path(base).stem}_tuned"
    description = f"{cfg.description + '; ' if cfg.description else ''}tuned by trainctl tune: {label}"
    pinned = dataclasses.replace(cfg, recipe=recipe, name="", description=description)
    path = folder / f"{recipe}.yaml"
    path.write_text("# @package _global_\n# Written by `trainctl tune`: the fastest measured layout.\n"
                    + to_yaml(pinned))
    return path


def tune(overrides: Sequence[str] | None = None, config_dirs: ConfigDirs = None, *, top: int = DEFAULT_TOP,
         probe_steps: int = DEFAULT_PROBE_STEPS, probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S, name: str = "",
         on_probe: Callable[[Probe, int, int], None] | None = None,
         on_output: Callable[[bytes], None] | None = None) -> TuneResult:
    """Rank, probe the top `top` here one after another (`on_probe(probe, i, total)` before each), write the table
    (NAME/tune.json) and the winner's pinned recipe. On Slurm: submit the probes as one job array and return (the
    table comes from `tuning_slurm.collect` once they ended)."""
    from trainctl.launch.rundir import check_name
    from trainctl.plan import tune as planner

    if top < 1 or probe_steps < 2:
        raise UserError([f"--top {top} --probe-steps {probe_steps}: probe at least 1 layout for at least 2 steps"])
    if not probe_timeout_s > 0:  # also NaN
        raise UserError([f"--probe-timeout {probe_timeout_s:g}: give the seconds before a probe counts as hung (> 0)"])
    overrides = override_list(overrides)
    cfg = resolved(overrides, config_dirs)
    ranked = planner.rank(cfg)
    if not ranked:
        raise UserError(["no layout fits this cluster; see `trainctl plan` for the memory breakdown"])
    name = name or f"{Path(cfg.recipe).stem or cfg.model.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    check_name(name)  # one plain directory name under RUNS_DIR/tune
    folder = (Path(cfg.runs_dir) / "tune" / name).absolute()  # the pinned recipe is named from anywhere
    if folder.exists():
        raise UserError([f"--name {name}: {folder} already exists; pick another name"])
    folder.mkdir(parents=True)
    result = TuneResult(name, folder, probe_steps, len(ranked), base_overrides=overrides)
    short = probe_overrides(cfg.schedule.warmup_steps, probe_steps) + [f"runs_dir={folder}"]
    probes = [Probe(c.label, list(c.overrides), i + 1, c.predicted_tokens_per_s, c.peak_bytes)
              for i, c in enumerate(ranked[:top])]
    result.probes = probes
    if not cfg.cluster.on_this_machine:
        from trainctl.api import tuning_slurm

        short.append(f"cluster.time_limit={tuning_slurm.time_limit(probe_timeout_s)}")  # a hang ends with its job
        tuning_slurm.submit_probes(result, [(p, merged(overrides, p.overrides, short)) for p in probes], config_dirs)
        tuning_slurm.write(result)
        return result
    from trainctl.launch.sweep import terminate_as_interrupt

    try:
        with terminate_as_interrupt():  # SIGTERM/SIGHUP as Ctrl-C: the running probe is stopped, not orphaned
            for i, probe in enumerate(probes):
                if on_probe is not None:
                    on_probe(probe, i, len(probes))
                _run_probe(probe, merged(overrides, probe.overrides, short), config_dirs, f"probe-{i + 1:02d}",
                           probe_timeout_s, on_output)
    except KeyboardInterrupt:
        result.interrupted = True  # the table of what finished, but no pinned recipe: the race was not run out
        finish(result, lambda p: ranked[p.predicted_rank - 1].cfg)
        raise TuneInterrupted(result) from None
    return finish(result, lambda p: ranked[p.predicted_rank - 1].cfg)


def finish(result: TuneResult, cfg_of: Callable[[Probe], object]) -> TuneResult:
    """Sort by measured tokens/s (failed last), pin the winner (its config from `cfg_of`), write tune.json."""
    result.probes.sort(key=lambda p: (not p.ok, -(p.measured_tokens_per_s or 0.0)))
    if (best := result.winner) is not None and not result.interrupted:
        result.recipe_file = pin(cfg_of(best), result.folder, best.label)
    (result.folder / TUNE_JSON).write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    return result
