"""The worker's console lines: short, readable, under 100 columns; every field stays in metrics.jsonl (and the
peak memory of a CUDA step in TensorBoard, W&B and `status`)."""

from __future__ import annotations

from trainctl.train.observe.console import console_line

TRAIN = {"kind": "train", "step": 100, "loss": 2.028, "lr": 3e-4, "grad_norm": 0.4601, "tokens_per_s": 9187.2,
         "step_time_s": 0.4458, "tokens_seen": 409600, "guard_skipped_steps": 0, "guard_loss_spikes": 0,
         "mfu": 0.382, "peak_mem_gib": 61.2, "loss_scale": 65536.0}


def test_a_busy_train_line_fits_100_columns():
    line = console_line(TRAIN, total_steps=100_000)
    assert len(line) < 100, line
    assert line.startswith("step 100/100000  loss 2.0280  lr 3.0e-04") and "9.19k tok/s" in line
    assert "skipped" not in line  # guard counts only when something happened
    assert "skipped 2" in console_line({**TRAIN, "guard_skipped_steps": 2}, 10)


def test_every_kind_has_its_line_and_odd_records_still_show():
    assert console_line({"kind": "eval", "step": 25, "val_loss": 2.492}) == "eval step 25  val loss 2.4920"
    pairs = {"kind": "eval", "step": 25, "val_loss": 0.21, "reward_accuracy": 0.96875, "reward_margin": 1.25}
    assert console_line(pairs) == "eval step 25  val loss 0.2100  pair accuracy 96.9%  margin 1.25"
    final = console_line({"kind": "final", "steps": 100, "final_train_loss": 2.028, "initial_val_loss": 5.761,
                          "final_val_loss": 2.086, "wall_time_s": 51.5, "stopped": False})
    assert final == "final step 100  loss 2.0280  val loss 5.7610 -> 2.0860  52 s"
    ckpt = console_line({"kind": "checkpoint", "step": 6, "bytes": 37993435, "total_s": 0.17, "blocking_s": 0.17})
    assert ckpt == "checkpoint step 6  36.2 MiB in 0.17 s (blocking 0.17 s)"
    resume = {"kind": "resume", "step": 10, "checkpoint": "checkpoints/step-00000010", "samples_seen": 1280}
    assert console_line(resume) == "resumed at step 10 from checkpoints/step-00000010 (1,280 samples seen)"
    older = {k: v for k, v in resume.items() if k != "samples_seen"}  # metrics.jsonl from before the count
    assert console_line(older) == "resumed at step 10 from checkpoints/step-00000010"
    assert console_line({"kind": "eval", "step": 3}) == "kind=eval step=3"  # no val_loss: field by field
    assert console_line({"kind": "other", "x": 1.23456, "ranks": [1, 2]}) == "kind=other x=1.235"


def test_empty_batches_are_shown_when_there_are_some():
    assert "empty batches 3" in console_line({**TRAIN, "guard_empty_batches": 3}, 10)
    assert "empty batches" not in console_line({**TRAIN, "guard_empty_batches": 0}, 10)
