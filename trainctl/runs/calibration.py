"""The plan's own error: past runs of the same model and layout under runs_dir, their measured speed and peak
against what their plans predicted (trainctl/core/measured.py).

"The same" is the run's config.yaml read as plain YAML (fast, no validation): the model, the precision, the
sharding, the batch shape and checkpointing, and the cluster's shape and device. Run directories directly under
runs_dir and `trainctl tune`'s probes (runs_dir/tune/NAME/probe-NN) are read, newest first, at most MAX_RUNS.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import yaml

from trainctl.config.load import to_yaml
from trainctl.config.schema import RunConfig
from trainctl.core import rundir as layout
from trainctl.core.measured import performance

MAX_RUNS = 200
TRAIN_KEYS = ("micro_batch", "grad_accum", "global_batch", "seq_len", "activation_checkpointing", "ac_every")
CLUSTER_KEYS = ("nodes", "procs_per_node", "device", "gpu")


def signature(config: dict) -> tuple | None:
    """What makes two runs' speed and memory comparable; None for a config that is not a run's."""
    try:
        train, cluster = config["train"], config["cluster"]
        return (repr(config["model"]), repr(config["precision"]), repr(config["sharding"]),
                tuple(train.get(k) for k in TRAIN_KEYS), tuple(cluster.get(k) for k in CLUSTER_KEYS))
    except (KeyError, TypeError, AttributeError):
        return None


def _run_dirs(runs_dir: Path) -> list[Path]:
    try:
        found = [p for p in runs_dir.glob("*") if (p / layout.CONFIG).is_file()]
        found += [p for p in runs_dir.glob("tune/*/*") if (p / layout.CONFIG).is_file()]
        return sorted(found, key=lambda p: (p / layout.CONFIG).stat().st_mtime, reverse=True)[:MAX_RUNS]
    except OSError:
        return []


def _config(run_dir: Path) -> dict:
    try:
        data = yaml.safe_load((run_dir / layout.CONFIG).read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def calibration(cfg: RunConfig, runs_dir: Path | None = None) -> dict | None:
    """The measured runs like `cfg` and the plan's mean error on them; None when there are none."""
    wanted = signature(yaml.safe_load(to_yaml(cfg)))
    root = Path(runs_dir or cfg.runs_dir)
    matches = [d for d in _run_dirs(root) if signature(_config(d)) == wanted]
    perfs = [(d, p) for d in matches if (p := performance(d))["measured"]["peak_bytes"] is not None
             or p["measured"]["tokens_per_s"] is not None]
    if not perfs:
        return None

    def values(side: str, key: str) -> list[float]:
        return [p[side][key] for _, p in perfs if p[side][key] is not None]

    return {
        "runs": len(perfs),
        "measured_tokens_per_s": _mean(values("measured", "tokens_per_s")),
        "measured_peak_bytes": max(values("measured", "peak_bytes"), default=None),
        "tokens_per_s_error": _mean(values("error", "tokens_per_s")),
        "peak_bytes_error": _mean(values("error", "peak_bytes")),
        "newest": str(perfs[0][0].relative_to(root)),
    }
