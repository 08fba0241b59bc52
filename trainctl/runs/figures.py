"""A run's measured MFU and peak memory next to its plan's figures, for `trainctl runs` and `status`.

Read from the run directory only (launcher side: no torch): plan.json for the plan's assumed MFU
and predicted per-rank peak, metrics.jsonl for the measured ones. The memory record is written
early (one step's peak, trainctl/train/observe/peak_memory.py), so it is looked for near the file's start;
MFU is the median of the train records near its end (the recent steps, warm-up long gone).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from trainctl.core import rundir
from trainctl.core.objectives import PAIR_METRICS

HEAD_BYTES = 256 * 1024  # the memory record comes after a few steps' records
TAIL_BYTES = 64 * 1024
GIB = 2**30
RECENT = 5  # train records whose median is "the recent pace"
SPARK = 24  # losses in a sparkline
BARS = "▁▂▃▄▅▆▇█"


@dataclass(frozen=True)
class Figures:
    mfu: float | None = None  # measured: median of the recent train records (CUDA with a known GPU only)
    plan_mfu: float | None = None
    peak_bytes: int | None = None  # measured: the busiest rank's step peak
    plan_peak_bytes: int | None = None  # predicted for the busiest rank
    peak_source: str = ""  # cuda_max_memory_allocated | cpu_tracked_tensors
    loss: float | None = None  # the last train record's
    val_loss: float | None = None  # the last eval record's
    tokens_per_s: float | None = None  # median of the recent train records
    step_time_s: float | None = None  # median of the recent train records
    losses: tuple[float, ...] = ()  # the recent train losses, oldest first (for a sparkline)
    preference: dict | None = None  # train.objective=dpo|simpo: the last train record's pair metrics
    experts: dict | None = None  # a mixture of experts: the last train record's aux loss, imbalance, dropped tokens
    tasks: dict | None = None  # `trainctl eval --tasks`: {"step": N, "tasks": {task: {metric: value}}} (lm_eval.json)

    def eta_s(self, step: int | None, steps: int | None) -> float | None:
        """Seconds left at the recent pace, or None."""
        if step is None or not steps or self.step_time_s is None:
            return None
        return max(steps - step, 0) * self.step_time_s

    def as_dict(self) -> dict:
        return {"loss": self.loss, "val_loss": self.val_loss, "tokens_per_s": self.tokens_per_s,
                "step_time_s": self.step_time_s, "mfu": self.mfu, "plan_mfu": self.plan_mfu,
                "peak_bytes": self.peak_bytes, "plan_peak_bytes": self.plan_peak_bytes,
                **({"lm_eval": self.tasks} if self.tasks else {}),
                **({"preference": self.preference} if self.preference else {}),
                **({"experts": self.experts} if self.experts else {})}

    def tasks_text(self) -> str:
        """'hellaswag acc 0.2610, arc_easy acc 0.4010 (step 300)': each task's first metric; '' without any."""
        if not self.tasks:
            return ""
        shown = ", ".join(f"{task} {metric} {value:.4f}" for task, metrics in self.tasks["tasks"].items()
                          for metric, value in list(metrics.items())[:1])
        return f"{shown} (step {self.tasks['step']})" if self.tasks.get("step") is not None else shown

    def preference_text(self) -> str:
        """'accuracy 97.5%, margin 1.234, logp chosen -12.30 rejected -20.10'; '' for SFT."""
        p = self.preference
        if not p:
            return ""
        parts = [f"accuracy {p['reward_accuracy']:.1%}" if "reward_accuracy" in p else "",
                 f"margin {p['reward_margin']:.4g}" if "reward_margin" in p else "",
                 f"logp chosen {p['logp_chosen']:.2f} rejected {p['logp_rejected']:.2f}"
                 if "logp_chosen" in p and "logp_rejected" in p else ""]
        return ", ".join(part for part in parts if part)

    def experts_text(self) -> str:
        """'aux 0.02013, imbalance 1.42 (worst layer 1; mean 1.21), dropped 0'; '' for a dense model."""
        e = self.experts
        if not e:
            return ""
        parts = [f"aux {e['aux_loss']:.4g}" if "aux_loss" in e else "",
                 f"imbalance {e['imbalance']:.3g} (worst layer {e['worst_layer']}; mean {e['imbalance_mean']:.3g})"
                 if "imbalance" in e else "",
                 f"dropped {e['dropped']}" if "dropped" in e else ""]
        return ", ".join(part for part in parts if part)

    def mfu_text(self) -> str:
        """'38.2% (plan 40%)', '- (plan 40%)', or '-'."""
        measured = "-" if self.mfu is None else f"{self.mfu:.1%}"
        return measured if self.plan_mfu is None else f"{measured} (plan {self.plan_mfu:.0%})"

    def peak_text(self) -> str:
        """'61.2 GiB (plan 60.3 GiB)', '91.3 MiB (plan 219.0 MiB)' and the like: MiB below 1 GiB, where GiB
        with one decimal would read 0.0."""
        measured = "-" if self.peak_bytes is None else memory_size(self.peak_bytes)
        return measured if self.plan_peak_bytes is None else f"{measured} (plan {memory_size(self.plan_peak_bytes)})"


def memory_size(value: float) -> str:
    """Bytes as GiB from 1 GiB up, as MiB below it (one decimal each)."""
    return f"{value / GIB:.1f} GiB" if abs(value) >= GIB else f"{value / 2**20:.1f} MiB"


def _records(path: Path, start: int, size: int) -> list[dict]:
    """Whole JSON objects within [start, start + size) of a JSON-lines file (a cut first or last line is skipped)."""
    f = rundir.open_regular(path)  # never a FIFO planted in a shared runs folder
    if f is None:
        return []
    try:
        with f:
            f.seek(start)
            lines = f.read(size).decode(errors="replace").splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def figures(run_dir: Path) -> Figures:
    """Measured and planned MFU and peak memory of a run (missing or malformed ones are None)."""
    plan = rundir.read_json(run_dir / rundir.PLAN)
    path = run_dir / rundir.METRICS
    try:
        size = path.stat().st_size
    except OSError:
        size = 0
    head = _records(path, 0, HEAD_BYTES)
    tail = _records(path, max(0, size - TAIL_BYTES), TAIL_BYTES) if size > HEAD_BYTES else head
    memory = next((r for r in head if r.get("kind") == "memory"), {})
    trains = [r for r in tail if r.get("kind") == "train"]
    evals = [r for r in tail if r.get("kind") == "eval"]
    mfus = [m for r in trains if (m := rundir.as_float(r.get("mfu"))) is not None]
    plan_mfu = rundir.as_float(plan.get("assumed_mfu")) if plan.get("device") == "cuda" else None
    plan_memory = plan.get("memory") if isinstance(plan.get("memory"), dict) else {}
    return Figures(
        mfu=statistics.median(mfus) if mfus else None,
        plan_mfu=plan_mfu,
        peak_bytes=rundir.as_int(memory.get("peak_bytes")),
        plan_peak_bytes=rundir.as_int(plan_memory.get("peak_bytes")),
        peak_source=rundir.as_str(memory.get("peak_source")),
        loss=rundir.as_float(trains[-1].get("loss")) if trains else None,
        val_loss=rundir.as_float(evals[-1].get("val_loss")) if evals else None,
        tokens_per_s=_median(trains[-RECENT:], "tokens_per_s"),
        step_time_s=_median(trains[-RECENT:], "step_time_s"),
        losses=tuple(x for r in trains[-SPARK:] if (x := rundir.as_float(r.get("loss"))) is not None),
        tasks=harness_scores(run_dir),
        preference=_pair_metrics(trains[-1]) if trains else None,
        experts=expert_metrics(trains[-1]) if trains else None,
    )


def _pair_metrics(record: dict) -> dict | None:
    """A preference step's pair metrics (core/objectives.py), None for an SFT record."""
    found = {k: v for k in PAIR_METRICS if (v := rundir.as_float(record.get(k))) is not None}
    return found or None


def expert_metrics(record: dict) -> dict | None:
    """A mixture of experts' step metrics (the keys train/loop/expert_load.py writes): the aux loss, the worst
    layer's load imbalance (max / mean tokens per expert), its mean over layers, and the tokens dropped over every
    layer; None for a dense model's record."""
    found = {}
    if (aux := rundir.as_float(record.get("aux_loss"))) is not None:
        found["aux_loss"] = aux
    imbalance = [rundir.as_float(v) for v in _as_list(record.get("expert_imbalance"))]
    if imbalance and None not in imbalance:
        worst = max(range(len(imbalance)), key=imbalance.__getitem__)
        found.update(imbalance=imbalance[worst], worst_layer=worst, imbalance_mean=statistics.fmean(imbalance))
    dropped = [rundir.as_int(v) for v in _as_list(record.get("expert_dropped"))]
    if dropped and None not in dropped:
        found["dropped"] = sum(dropped)
    return found or None


def _as_list(value) -> list:
    return value if isinstance(value, list) else []


def harness_scores(run_dir: Path) -> dict | None:
    """lm_eval.json's step and numeric metrics per task (what `trainctl eval --tasks` wrote), None without them."""
    record = rundir.read_json(run_dir / rundir.LM_EVAL)
    tasks = record.get("tasks") if isinstance(record.get("tasks"), dict) else {}
    found = {str(task): {str(k): float(v) for k, v in metrics.items()
                         if isinstance(v, int | float) and not isinstance(v, bool)}
             for task, metrics in tasks.items() if isinstance(metrics, dict)}
    found = {task: metrics for task, metrics in found.items() if metrics}
    return {"step": rundir.as_int(record.get("step")), "tasks": found} if found else None


def _median(records: list[dict], key: str) -> float | None:
    values = [v for r in records if (v := rundir.as_float(r.get(key))) is not None]
    return statistics.median(values) if values else None


def sparkline(values: tuple[float, ...]) -> str:
    """'▇▆▄▃▂▂▁' for a falling loss; '' when there is nothing to draw."""
    finite = [v for v in values if v == v and abs(v) != float("inf")]
    if len(finite) < 2:
        return ""
    low, high = min(finite), max(finite)
    span = (high - low) or 1.0
    return "".join(BARS[min(int((v - low) / span * len(BARS)), len(BARS) - 1)] for v in finite)
