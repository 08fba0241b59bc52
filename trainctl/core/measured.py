"""A run's speed and peak memory, predicted (plan.json) and measured (rank 0's metrics.jsonl), side by side.

Torch-free and read from the run directory alone, so the worker puts it in result.json and the launcher (`trainctl
tune`) reads the same numbers from a probe. Measured tokens/s is the median of the logged steps after the first
quarter (start-up and allocator warm-up are not the run's speed); the measured peak is the busiest rank's step
peak of the `memory` record. A figure nobody predicted or measured is None; `error` is measured / predicted - 1.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from trainctl.core import rundir as layout


def measured(run_dir: Path) -> tuple[float | None, int | None]:
    """(tokens/s, peak bytes) that the run logged (module doc)."""
    records = layout.metrics(run_dir)
    train = [r for r in layout.latest_per_step(records, "train") if _number(r.get("tokens_per_s"))]
    speeds = [r["tokens_per_s"] for r in train[len(train) // 4:]]
    peaks = [r["peak_bytes"] for r in records if r.get("kind") == "memory" and _number(r.get("peak_bytes"))]
    return (statistics.median(speeds) if speeds else None), (max(peaks) if peaks else None)


def predicted(run_dir: Path) -> tuple[float | None, int | None]:
    """(tokens/s, peak bytes) of the run's plan (tokens/s: None without the device's peak FLOP/s)."""
    plan = layout.read_json(Path(run_dir) / layout.PLAN)
    tokens = (plan.get("throughput") or {}).get("tokens_per_s")
    peak = (plan.get("memory") or {}).get("peak_bytes")
    return (tokens if _number(tokens) else None), (peak if _number(peak) else None)


def error(measured_value: float | None, predicted_value: float | None) -> float | None:
    return None if measured_value is None or not predicted_value else measured_value / predicted_value - 1


def performance(run_dir: Path) -> dict:
    """result.json's `performance`: predicted and measured tokens/s and peak bytes, and the error of each."""
    tokens, peak = measured(run_dir)
    plan_tokens, plan_peak = predicted(run_dir)
    return {
        "predicted": {"tokens_per_s": plan_tokens, "peak_bytes": plan_peak},
        "measured": {"tokens_per_s": tokens, "peak_bytes": peak},
        "error": {"tokens_per_s": error(tokens, plan_tokens), "peak_bytes": error(peak, plan_peak)},
    }


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
