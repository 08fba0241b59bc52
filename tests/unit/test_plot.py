"""`trainctl plot`: a PNG with the runs' curves overlaid, drawn from metrics.jsonl."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import make_run, run_cli
from trainctl.launch.errors import LaunchError
from trainctl.runs.plot import plot, series, worst_layer

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


def a_preference_run(root, name: str, steps: int = 20):
    """A DPO run's records: the pair metrics rise on train records and on the eval records at 10 and 20."""
    def pairs(s: int) -> dict:
        return {"reward_accuracy": 0.5 + s / (2 * steps), "reward_margin": s / 4, "reward_chosen": s / 8,
                "reward_rejected": -s / 8}

    records = [{"kind": "train", "step": s, "loss": 0.7 / s, "lr": 1e-3, "tokens_per_s": 100.0, "grad_norm": 1.0,
                **pairs(s)} for s in range(1, steps + 1)]
    records += [{"kind": "eval", "step": s, "val_loss": 0.7 / s, **pairs(s)} for s in (10, 20)]
    return make_run(root, name, steps=steps, metrics=records)


def third_row_pixels(tmp_path, run) -> int:
    """`run`'s plot has a third row of panels beside a plain run's two; the run's color (C0) pixels in that row."""
    import matplotlib.image

    plain = plot([a_run(tmp_path, "plain", 1.0)], tmp_path / "plain.png")
    extra = plot([run], tmp_path / f"{run.name}.png")
    plain_rows, extra_rows = (matplotlib.image.imread(str(p)).shape[0] for p in (plain, extra))
    assert extra_rows == plain_rows * 3 // 2  # a third row of panels
    bottom = tmp_path / "bottom.png"  # the third row alone
    matplotlib.image.imsave(bottom, matplotlib.image.imread(str(extra))[plain_rows:])
    return colored_pixels(bottom, (0.122, 0.467, 0.706))


def test_preference_runs_add_a_row_of_pair_metrics(tmp_path):
    assert third_row_pixels(tmp_path, a_preference_run(tmp_path, "dpo")) > 500
    assert series(tmp_path / "dpo", "eval", "reward_accuracy") == ([10, 20], [0.75, 1.0])


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


def a_moe_run(root, name: str, steps: int = 20):
    """A mixture of experts' records: the aux loss and each layer's imbalance per train step (layer 1 the worse)."""
    records = [{"kind": "train", "step": s, "loss": 5 / s, "lr": 1e-3, "tokens_per_s": 100.0, "grad_norm": 1.0,
                "aux_loss": 0.02 - s / 1e4, "expert_imbalance": [1.2, 1.0 + 1 / s], "expert_dropped": [0, 0],
                "expert_load": [[4, 4], [6, 2]]} for s in range(1, steps + 1)]
    return make_run(root, name, steps=steps, metrics=records)


def test_moe_runs_add_a_row_of_aux_loss_and_the_worst_layers_imbalance(tmp_path):
    assert third_row_pixels(tmp_path, a_moe_run(tmp_path, "moe")) > 500
    steps, worst = worst_layer(tmp_path / "moe")
    assert steps[:2] == [1, 2] and worst[:2] == [2.0, 1.5] and worst[-1] == 1.2  # layer 1 until it evens out
