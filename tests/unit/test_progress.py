"""The launcher's progress bar: lines pass through above it, its position follows metrics.jsonl."""

from __future__ import annotations

import io
import json

from rich.console import Console

from tests.helpers import wait_for
from trainctl.launch.backends.local.progress import ProgressSink


def test_progress_follows_metrics_and_passes_lines(tmp_path):
    screen = io.StringIO()
    sink = ProgressSink(tmp_path, total_steps=40, console=Console(file=screen, force_terminal=True, width=100))
    sink.write(b"[default0]:world 2 on cpu\n[default0]:kind=tr")  # a line split across chunks
    assert sink.step == 0  # no metrics.jsonl yet
    with (tmp_path / "metrics.jsonl").open("w") as f:
        f.write(json.dumps({"kind": "eval", "step": 0, "val_loss": 5.0}) + "\n")
        f.write(json.dumps({"kind": "train", "step": 10, "loss": 3.25}) + "\n")
        f.write('{"kind": "train", "step": 20, "lo')  # still being written
    sink.write(b"ain step=10 loss=3.25\n")
    assert sink.step == 10
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('ss": 2.5}\n')
    sink.write(b"[default0]:kind=train step=20 loss=2.5\n")
    assert sink.step == 20
    sink.close()
    shown = screen.getvalue()
    assert "world 2 on cpu" in shown
    assert "[default0]:kind=train step=10 loss=3.25" in shown  # the split line arrived whole
    assert "20/40" in shown and "loss 2.5000" in shown and "eta" in shown


def test_a_bad_line_never_stops_the_output_and_a_rewritten_file_is_followed(tmp_path):
    screen = io.StringIO()
    sink = ProgressSink(tmp_path, total_steps=40, console=Console(file=screen, force_terminal=True, width=100))
    with (tmp_path / "metrics.jsonl").open("w") as f:
        f.write('[1, 2]\n{"kind": "train", "step": "x"}\n\xff\n{"kind": "train", "step": 12, "loss": null}\n')
    sink.write(b"[default0]:after the bad lines\n")
    assert sink.step == 12
    # A resume rewrites metrics.jsonl (records past its step dropped), shorter than what was read.
    replacement = tmp_path / "new.jsonl"
    replacement.write_text(json.dumps({"kind": "train", "step": 5, "loss": 2.0}) + "\n")
    replacement.replace(tmp_path / "metrics.jsonl")
    sink.write(b"[default0]:resumed\n")
    assert sink.step == 5
    sink.close()
    assert "after the bad lines" in screen.getvalue() and "resumed" in screen.getvalue()


def test_the_bar_moves_every_step_from_progress_json(tmp_path):

    from trainctl.core import rundir

    screen = io.StringIO()
    sink = ProgressSink(tmp_path, total_steps=40, console=Console(file=screen, force_terminal=True, width=100),
                        poll_s=0.01)
    rundir.write_json_atomic(tmp_path / rundir.PROGRESS, {"step": 3})  # no train record yet (log_every=10)
    wait_for(lambda: sink.step == 3, "the bar at step 3", timeout=5)
    rundir.write_json_atomic(tmp_path / rundir.PROGRESS, {"step": 4})
    wait_for(lambda: sink.step == 4, "the bar at step 4", timeout=5)
    sink.close()
    assert sink.step == 4 and "4/40" in screen.getvalue()
