"""`trainctl plot RUN [RUN...]`: one PNG of train and eval loss, learning rate and tokens/s, runs overlaid.

Preference runs (train.objective=dpo|simpo) add a row: the pair accuracy (train solid, held-out dashed) and the
implicit rewards (margin solid, chosen dotted, rejected dash-dot), from the keys core/objectives.py names.
Mixture-of-experts runs add a row: the auxiliary (load-balancing) loss and the expert load imbalance (max / mean
tokens per expert) of the worst layer, from the keys train/loop/expert_load.py writes.

Reads metrics.jsonl through the run-directory module (each step once, after resumes too); matplotlib
is imported here only, with its file-only backend, so the command works on a login node without a display.
"""

from __future__ import annotations

from pathlib import Path

from trainctl.core import rundir
from trainctl.launch.errors import LaunchError

PANELS = (("loss", "train loss (solid), eval loss (dashed)"), ("lr", "learning rate"),
          ("tokens_per_s", "tokens/s"), ("grad_norm", "grad norm"))
PAIR_PANELS = (("reward_accuracy", "pair accuracy: train (solid), eval (dashed)"),
               ("reward_margin", "rewards: margin (solid), chosen (dotted), rejected (dash-dot)"))
REWARD_STYLES = (("reward_margin", "-"), ("reward_chosen", ":"), ("reward_rejected", "-."))
EXPERT_PANELS = (("aux_loss", "auxiliary (load-balancing) loss"),
                 ("expert_imbalance", "expert load imbalance (max / mean), worst layer"))


def series(run_dir: Path, kind: str, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one key of one record kind, each step once."""
    points = [(rundir.as_int(r.get("step")), rundir.as_float(r.get(key)))
              for r in rundir.latest_per_step(rundir.metrics(run_dir), kind)]
    points = [(s, v) for s, v in points if s is not None and v is not None]
    return [s for s, _ in points], [v for _, v in points]


def worst_layer(run_dir: Path, key: str = "expert_imbalance") -> tuple[list[int], list[float]]:
    """(steps, the largest of the per-layer values) of a list-valued train key, each step once."""
    points = []
    for r in rundir.latest_per_step(rundir.metrics(run_dir), "train"):
        values = r.get(key) if isinstance(r.get(key), list) else []
        floats = [rundir.as_float(v) for v in values]
        step = rundir.as_int(r.get("step"))
        if floats and None not in floats and step is not None:
            points.append((step, max(floats)))
    return [s for s, _ in points], [v for _, v in points]


FORMATS = (".png", ".svg", ".pdf")  # what matplotlib's Agg backend writes and an image viewer opens


def target_path(out: Path) -> Path:
    """Where `--out` writes: the file itself, or plot.png inside an existing folder; LaunchError (one line) for a
    format matplotlib would not write or a place no file can be (under a regular file)."""
    out = Path(out)
    if str(out).strip() in ("", "."):
        out = Path(".")
    if out.is_dir():
        out = out / "plot.png"
    if out.suffix.lower() not in FORMATS:
        raise LaunchError(f"--out {out}: not an image file name; end it in {', '.join(FORMATS)} "
                          "(or name an existing folder to write plot.png there)")
    for parent in out.parents:
        if parent.exists() and not parent.is_dir():
            raise LaunchError(f"--out {out}: {parent} is a file, not a folder; choose another path")
    if out.exists() and not out.is_file():
        raise LaunchError(f"--out {out}: exists and is not a regular file; choose another path")
    return out


def _curve(ax, run_dir: Path, key: str, color: str, label: str) -> None:
    """One key's train curve, and its held-out one dashed where eval records carry it (val_loss for the loss)."""
    steps, values = series(run_dir, "train", key)
    if steps:
        ax.plot(steps, values, color=color, label=label, linewidth=1.2)
    steps, values = series(run_dir, "eval", "val_loss" if key == "loss" else key)
    if steps:
        ax.plot(steps, values, color=color, linestyle="--", marker="o", markersize=3)


def _rewards(ax, run_dir: Path, color: str) -> None:
    """The train records' implicit rewards of one run, one line style each."""
    for key, style in REWARD_STYLES:
        steps, values = series(run_dir, "train", key)
        if steps:
            ax.plot(steps, values, color=color, linestyle=style, linewidth=1.2)


def plot(run_dirs: list[Path], out: Path, labels: list[str] | None = None) -> Path:
    """Draw the runs into `out` (PNG); a LaunchError when none has a training record yet."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = labels or [p.name for p in run_dirs]
    drawn = [p for p in run_dirs if series(p, "train", "loss")[0]]
    if not drawn:
        raise LaunchError(f"nothing to plot: no training step logged yet in {', '.join(map(str, run_dirs))}")
    pairs = any(series(p, "train", "reward_accuracy")[0] for p in drawn)
    experts = any(worst_layer(p)[0] for p in drawn)
    panels = PANELS + (PAIR_PANELS if pairs else ()) + (EXPERT_PANELS if experts else ())
    fig, axes = plt.subplots(len(panels) // 2, 2, figsize=(12, 4 * len(panels) // 2), sharex=True)
    for index, (run_dir, label) in enumerate(zip(run_dirs, labels, strict=True)):
        color = f"C{index % 10}"
        for ax, (key, title) in zip(axes.flat, panels, strict=True):
            if key == "reward_margin":
                _rewards(ax, run_dir, color)
            elif key == "expert_imbalance":
                ax.plot(*worst_layer(run_dir), color=color, linewidth=1.2)
            else:
                _curve(ax, run_dir, key, color, label)
            ax.set_title(title)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    axes.flat[0].legend(fontsize="small")
    fig.tight_layout()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=100)
    except OSError as exc:
        raise LaunchError(f"--out {out}: cannot write it ({exc.strerror or exc}); choose another path") from None
    finally:
        plt.close(fig)
    return out
