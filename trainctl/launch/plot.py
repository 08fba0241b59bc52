"""`trainctl plot RUN [RUN...]`: one PNG of train and eval loss, learning rate and tokens/s, runs overlaid.

Reads metrics.jsonl through the run-directory module (each step once, after resumes too); matplotlib
is imported here only, with its file-only backend, so the command works on a login node without a display.
"""

from __future__ import annotations

from pathlib import Path

from trainctl.core import rundir
from trainctl.launch.errors import LaunchError

PANELS = (("loss", "train loss (solid), eval loss (dashed)"), ("lr", "learning rate"),
          ("tokens_per_s", "tokens/s"), ("grad_norm", "grad norm"))


def series(run_dir: Path, kind: str, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one key of one record kind, each step once."""
    points = [(rundir.as_int(r.get("step")), rundir.as_float(r.get(key)))
              for r in rundir.latest_per_step(rundir.metrics(run_dir), kind)]
    points = [(s, v) for s, v in points if s is not None and v is not None]
    return [s for s, _ in points], [v for _, v in points]


def plot(run_dirs: list[Path], out: Path, labels: list[str] | None = None) -> Path:
    """Draw the runs into `out` (PNG); a LaunchError when none has a training record yet."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = labels or [p.name for p in run_dirs]
    drawn = [p for p in run_dirs if series(p, "train", "loss")[0]]
    if not drawn:
        raise LaunchError(f"nothing to plot: no training step logged yet in {', '.join(map(str, run_dirs))}")
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    for index, (run_dir, label) in enumerate(zip(run_dirs, labels, strict=True)):
        color = f"C{index % 10}"
        for ax, (key, title) in zip(axes.flat, PANELS, strict=True):
            steps, values = series(run_dir, "train", key)
            if steps:
                ax.plot(steps, values, color=color, label=label, linewidth=1.2)
            if key == "loss":
                steps, values = series(run_dir, "eval", "val_loss")
                if steps:
                    ax.plot(steps, values, color=color, linestyle="--", marker="o", markersize=3)
            ax.set_title(title)
    for ax in axes[1]:
        ax.set_xlabel("step")
    axes.flat[0].legend(fontsize="small")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
