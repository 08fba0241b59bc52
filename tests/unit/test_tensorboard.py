"""TensorBoard event files read back with tensorboard's own reader: namespaced scalars, no duplicates on resume."""

from __future__ import annotations

import pytest

from trainctl.config.schema import LoggingConfig
from trainctl.train.observe.metrics import MetricsLogger
from trainctl.train.observe.scalars import scalars

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def read_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def logger(run_dir) -> MetricsLogger:
    return MetricsLogger(run_dir, LoggingConfig(progress=False), total_steps=6, is_main=True, config={})


def train(m: MetricsLogger, step: int, attempt: int) -> None:
    m.train(step, {"loss": 10.0 * attempt + step, "lr": 0.1, "tokens_per_s": 100.0, "guard_skipped_steps": 0})


def test_scalars_are_namespaced_and_a_resume_leaves_each_step_once(tmp_path):
    first = logger(tmp_path)
    for step in range(1, 6):
        train(first, step, attempt=1)
    first.eval(5, 2.5)
    first.close()  # a crash after step 5; the newest checkpoint is step 3
    second = logger(tmp_path)
    second.resumed(3, "checkpoints/step-00000003", 24)
    for step in range(4, 7):
        train(second, step, attempt=2)
    second.eval(6, 2.0)
    second.close()
    got = read_scalars(tmp_path)
    assert got["train/loss"] == [(1, 11.0), (2, 12.0), (3, 13.0), (4, 24.0), (5, 25.0), (6, 26.0)]
    assert got["eval/loss"] == [(6, 2.0)]  # step 5's eval belonged to the lost attempt
    assert {"train/lr", "perf/tokens_per_s", "guard/skipped_steps"} <= set(got)


def test_tensorboard_can_be_turned_off(tmp_path):
    m = MetricsLogger(tmp_path, LoggingConfig(progress=False, tensorboard=False), 3, True, {})
    train(m, 1, attempt=1)
    m.close()
    assert not (tmp_path / "tensorboard").exists()


def test_names_shared_by_tensorboard_and_wandb():
    record = {"kind": "train", "step": 3, "loss": 2.0, "mfu": 0.4, "peak_mem_gib": 12.0, "ranks": [1, 2],
              "stopped": False}
    assert scalars(record) == {"train/loss": 2.0, "perf/mfu": 0.4, "memory/peak_gib": 12.0}
    assert scalars({"kind": "eval", "step": 3, "val_loss": 1.5}) == {"eval/loss": 1.5}
