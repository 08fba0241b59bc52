"""`trainctl tune`'s table: each probed layout, its prediction and what it measured; the winner pinned as a recipe.

Shared by the tune that runs its probes here (tuning.py) and the one that queues them (tuning_queued.py).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from trainctl.core.measured import error

TUNE_JSON = "tune.json"


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
    repeats: list[float] = field(default_factory=list)  # each repeat's measured tokens/s (their median above)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def tokens_error(self) -> float | None:
        """measured / predicted - 1 (+0.10: 10% faster than predicted)."""
        return error(self.measured_tokens_per_s, self.predicted_tokens_per_s)

    @property
    def spread(self) -> float | None:
        """(slowest - fastest repeat) / their median: how far this machine's noise moved one layout's speed."""
        if len(self.repeats) < 2 or not self.measured_tokens_per_s:
            return None
        return (max(self.repeats) - min(self.repeats)) / self.measured_tokens_per_s

    @property
    def peak_error(self) -> float | None:
        return error(self.measured_peak_bytes, self.predicted_peak_bytes)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "tokens_error": self.tokens_error, "peak_error": self.peak_error,
                "spread": self.spread}


@dataclass
class TuneResult:
    name: str
    folder: Path
    probe_steps: int
    candidates: int  # the layouts that fit, of which the top were probed
    probes: list[Probe] = field(default_factory=list)  # sorted by measured tokens/s, failed ones last
    recipe_file: Path | None = None  # the pinned recipe of the winner (None: every probe failed)
    base_overrides: list[str] = field(default_factory=list)  # the user's (a collect composes the winner from them)
    job_id: str = ""  # a queued tune: the probes' job (on Slurm, their job array)
    message: str = ""  # a queued tune: what the submission said
    interrupted: bool = False  # Ctrl-C (or SIGTERM) ended the tune: the table holds the probes that finished
    filled: list[str] = field(default_factory=list)  # what tune derived for a start that did not suit the cluster
    repeats: int = 1  # runs of each probe
    noise: str = ""  # the ranking's top two within the repeats' noise: said, with what would separate them

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
                "interrupted": self.interrupted, "filled": self.filled, "repeats": self.repeats, "noise": self.noise}


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def merged(base: Sequence[str], *later: Sequence[str]) -> list[str]:
    """`base` without the keys a later list sets (Hydra refuses one key twice), then the later lists."""
    taken = {_key(o) for group in later for o in group}
    return [o for o in base if _key(o) not in taken] + [o for group in later for o in group]


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


def finish(result: TuneResult, cfg_of: Callable[[Probe], object]) -> TuneResult:
    """Sort by measured tokens/s (failed last), pin the winner (its config from `cfg_of`), write tune.json."""
    result.probes.sort(key=lambda p: (not p.ok, -(p.measured_tokens_per_s or 0.0)))
    result.noise = within_noise(result.probes)
    if (best := result.winner) is not None and not result.interrupted:
        result.recipe_file = pin(cfg_of(best), result.folder, best.label)
    (result.folder / TUNE_JSON).write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    return result


def within_noise(probes: list[Probe]) -> str:
    """A line when the two fastest layouts' repeats overlap (the slower one's best beat the winner's worst): their
    order is this machine's noise, not a measured difference; '' otherwise or without repeats."""
    ok = [p for p in probes if p.ok]
    if len(ok) < 2 or len(ok[0].repeats) < 2 or len(ok[1].repeats) < 2:
        return ""
    first, second = ok[0], ok[1]
    if min(first.repeats) > max(second.repeats):
        return ""
    return (f"within noise: {first.label} ({min(first.repeats):,.0f}-{max(first.repeats):,.0f} tokens/s) and "
            f"{second.label} ({min(second.repeats):,.0f}-{max(second.repeats):,.0f}) overlap across repeats; either "
            "will do, or tune again with more --probe-steps or --repeats to separate them")


def write(result: TuneResult) -> None:
    """NAME/tune.json as it stands (a queued tune: its probes submitted, nothing measured yet)."""
    (result.folder / TUNE_JSON).write_text(json.dumps(result.to_dict(), indent=2) + "\n")
