"""`trainctl eval --tasks` writes RUN/lm_eval.json; `runs` and `status` show its scores, and a broken file reads as
none (never an error)."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from tests.helpers import make_run
from trainctl.api.watching import RunInfo
from trainctl.render import runs_table, status_panel
from trainctl.runs.figures import figures
from trainctl.runs.registry import run_state

RECORD = {"step": 30, "checkpoint": "c", "limit": None,
          "tasks": {"tiny_qa": {"acc": 0.5, "acc_stderr": 0.2}, "other": {"word_perplexity": 41.25}}}


def shown(render, info) -> str:
    out = io.StringIO()
    render(Console(file=out, width=200, force_terminal=False), info)
    return out.getvalue()


def test_runs_and_status_show_the_harness_scores(tmp_path, capsys):
    run_dir = make_run(tmp_path / "runs", "a", launch={"launcher": "local", "exit_code": 0})
    plain = make_run(tmp_path / "runs", "b", launch={"launcher": "local", "exit_code": 0})
    (run_dir / "lm_eval.json").write_text(json.dumps(RECORD))
    info = RunInfo(run_state(run_dir), figures(run_dir))
    assert info.to_dict()["lm_eval"] == {"step": 30, "tasks": RECORD["tasks"]}
    assert "lm-eval  tiny_qa acc 0.5000, other word_perplexity 41.2500 (step 30)" in shown(status_panel, info)
    runs_table(Console(file=io.StringIO(), force_terminal=False), [info, RunInfo(run_state(plain), figures(plain))])
    header, first, second = capsys.readouterr().out.splitlines()  # not a terminal: tab-separated lines
    assert header.split("\t")[-2] == "lm-eval" and first.split("\t")[-2].startswith("tiny_qa acc 0.5000")
    assert second.split("\t")[-2] == "-"


def test_a_broken_record_reads_as_no_scores(tmp_path):
    run_dir = make_run(tmp_path / "runs", "a", launch={"launcher": "local", "exit_code": 0})
    for body in ("{", json.dumps({"tasks": [1]}), json.dumps({"tasks": {"t": {"acc": "high", "ok": True}}})):
        (run_dir / "lm_eval.json").write_text(body)
        assert figures(run_dir).tasks is None and "lm_eval" not in RunInfo(run_state(run_dir),
                                                                          figures(run_dir)).to_dict()


def test_status_shows_a_mixture_of_experts_aux_loss_imbalance_and_dropped_tokens(tmp_path):
    train = {"kind": "train", "step": 3, "loss": 5.0, "aux_loss": 0.0201, "expert_imbalance": [1.2, 1.5, 1.3],
             "expert_dropped": [0, 2, 1], "expert_load": [[4, 4], [6, 2], [5, 3]]}
    run_dir = make_run(tmp_path / "runs", "moe", launch={"launcher": "local", "exit_code": 0}, metrics=[train])
    dense = make_run(tmp_path / "runs", "dense", launch={"launcher": "local", "exit_code": 0},
                     metrics=[{"kind": "train", "step": 3, "loss": 5.0}])
    info = RunInfo(run_state(run_dir), figures(run_dir))
    assert info.to_dict()["experts"] == {"aux_loss": 0.0201, "imbalance": 1.5, "worst_layer": 1,
                                         "imbalance_mean": pytest.approx(4.0 / 3), "dropped": 3}
    assert "experts  aux 0.0201, imbalance 1.5 (worst layer 1; mean 1.33), dropped 3" in shown(status_panel, info)
    dense_info = RunInfo(run_state(dense), figures(dense))
    assert "experts" not in dense_info.to_dict() and "experts" not in shown(status_panel, dense_info)
    broken = {**train, "expert_imbalance": "high", "expert_dropped": [1, "x"], "aux_loss": None}
    (run_dir / "metrics.jsonl").write_text(json.dumps(broken) + "\n")
    assert figures(run_dir).experts is None  # a malformed record reads as none, never an error
