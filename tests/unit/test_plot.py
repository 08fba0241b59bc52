"""`trainctl plot`: a PNG with the runs' curves overlaid, drawn from metrics.jsonl."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import make_run, run_cli
from trainctl.launch.errors import LaunchError
from trainctl.runs.plot import plot, series

pytest.importorskip("matplotlib")


def a_run(root, name: str, scale: float, steps: int = 30):
    def train(s: int, loss: float) -> dict:
        return {"kind": "train", "step": s, "loss": loss, "lr": 1e-3 * (1 - s / steps), "tokens_per_s": 1000 + 10 * s,
                "grad_norm": 1.0 / s}

    # A first attempt logged steps 1-8 and died; the resume from step 5's checkpoint logged 5-30 again.
    records = [train(s, scale * 5 / s) for s in range(1, 6)] + [train(s, 99.0) for s in range(6, 9)]
    records += [train(s, scale * 5 / s) for s in range(5, steps + 1)]
    records += [{"kind": "eval", "step": s, "val_loss": scale * 6 / s} for s in (10, 20, 30)]
    return make_run(root, name, steps=steps, metrics=records)


def colored_pixels(png, rgb: tuple[float, float, float]) -> int:
    import matplotlib.image

    image = matplotlib.image.imread(str(png))[..., :3]
    return int(np.all(np.abs(image - np.asarray(rgb)) < 0.05, axis=-1).sum())


def test_two_runs_overlaid_in_one_png(tmp_path):
    a, b = a_run(tmp_path, "a", 1.0), a_run(tmp_path, "b", 2.0)
    out = plot([a, b], tmp_path / "sweep.png")
    assert out.stat().st_size > 20_000
    # matplotlib's first two colors (C0 blue, C1 orange): each run drew curves.
    assert colored_pixels(out, (0.122, 0.467, 0.706)) > 500
    assert colored_pixels(out, (1.0, 0.498, 0.055)) > 500
    steps, losses = series(a, "train", "loss")
    assert steps == list(range(1, 31))  # each step once, after the resume too
    assert losses == [5 / s for s in range(1, 31)]  # the lost attempt's 99s are gone


def test_nothing_to_plot_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.yaml").write_text("train:\n  steps: 3\n")
    with pytest.raises(LaunchError, match="nothing to plot"):
        plot([tmp_path / "empty"], tmp_path / "x.png")


@pytest.mark.cli
def test_the_cli_writes_the_png_next_to_the_run(tmp_path):
    a_run(tmp_path / "runs", "a", 1.0)
    proc = run_cli("plot", "a", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "runs" / "a" / "plot.png").stat().st_size > 10_000
    assert proc.probe == {"code": 0, "heavy": []}
