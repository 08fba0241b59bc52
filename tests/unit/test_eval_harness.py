"""`trainctl eval --tasks`: lm-evaluation-harness runs a local task (a YAML beside a .jsonl, no network) on a tiny
model through trainctl's LM, and its accuracy is the one the model's own log-probabilities give."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from trainctl.config.schema import ModelConfig
from trainctl.core import rundir as layout
from trainctl.core.errors import UserError
from trainctl.core.tool_options import EvalOptions
from trainctl.models.build import build_model
from trainctl.models.run_tokens import RunTokens

# The harness is an optional extra, imported inside the tests: its import alone takes seconds, so these run in
# the dist tier (in process, whole-model passes), not in the one-minute unit loop.
pytestmark = [pytest.mark.dist, pytest.mark.filterwarnings("ignore"),  # the harness's own deprecation chatter
              pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="pip install 'trainctl[eval]'")]

TINY = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=256, max_seq_len=32)
QUESTIONS = [{"question": f"{a} plus {b} is", "choices": [f" {a + b}", f" {a + b + 1}", "x"], "answer": i % 3}
             for i, (a, b) in enumerate([(1, 2), (3, 4), (2, 2), (5, 1), (0, 7), (6, 2)])]


def write_task(folder: Path) -> Path:
    data = folder / "qa.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    tasks = folder / "tasks"
    tasks.mkdir()
    (tasks / "tiny_qa.yaml").write_text(
        "task: tiny_qa\ndataset_path: json\ndataset_kwargs:\n"
        f"  data_files:\n    test: {data}\n  cache_dir: {folder / 'cache'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n")
    return tasks


@pytest.fixture
def tiny():
    torch.manual_seed(0)
    model = build_model(TINY, "cpu")
    model.init_weights()
    return model.eval()


@pytest.mark.slow  # the harness indexes the few thousand task files it ships before it runs one
def test_a_local_task_scores_what_the_models_log_probabilities_say(tmp_path, tiny, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # The harness records the machine's environment by starting programs, which the unit tier forbids; it is a
    # record only, not part of the score. (Its git commit lookup run_tasks makes read files: no program.)
    monkeypatch.setattr("lm_eval.evaluator.add_env_info", lambda results: None)
    from lm_eval.api.model import LM

    from trainctl.train import harness

    tasks = write_task(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    options = EvalOptions(tasks="tiny_qa", include_path=str(tasks))
    tokens = RunTokens("bytes", [0])
    checked = harness.checked_with(options, tokens)
    found, path = harness.run_tasks(run_dir, options, checked, tiny, torch.device("cpu"),
                                    run_dir / "checkpoints" / "step-00000003")
    lm = harness.run_lm_class(LM)(tiny, torch.device("cpu"), tokens)
    right = 0
    for q in QUESTIONS:  # the harness's acc: the choice of the highest summed log-probability is the answer
        scores = [lm._score(tokens.encode(q["question"]), tokens.encode(c))[0] for c in q["choices"]]
        right += max(range(3), key=scores.__getitem__) == q["answer"]
    assert found["tiny_qa"]["acc"] == pytest.approx(right / len(QUESTIONS))
    assert list(found["tiny_qa"]) == ["acc", "acc_stderr"]  # scores only (no alias, no sample count)
    record = json.loads((run_dir / layout.LM_EVAL).read_text())
    assert path == str(run_dir / layout.LM_EVAL) and record["step"] == 3 and record["tasks"] == found
    with pytest.raises(UserError, match="no_such_task: not a task lm-evaluation-harness knows"):
        harness.checked_with(replace(options, tasks="tiny_qa,no_such_task"), tokens)


def test_rolling_loglikelihood_is_the_sum_over_windows_that_do_not_overlap(tiny):
    from lm_eval.api.model import LM

    from trainctl.train import harness

    tokens = RunTokens("bytes", [0])
    lm = harness.run_lm_class(LM)(tiny, torch.device("cpu"), tokens)
    text = "a text longer than the model's thirty-two token context, read in two windows"
    ids = tokens.encode(text)
    logprobs = lm._logprobs([0] + ids[:32])  # the first window after the end-of-text id
    want = float(logprobs.gather(1, torch.tensor(ids[:32])[:, None]).sum())
    for start in range(32, len(ids), 32):
        window = ids[start:start + 32]
        want += lm._score([ids[start - 1]], window)[0]

    class Request:
        args = (text,)

    assert lm.loglikelihood_rolling([Request()])[0] == want  # the same windows, the same arithmetic


def test_the_harness_looks_up_the_commit_without_running_git(tmp_path, monkeypatch, capfd):
    """lm-eval ran `git describe` with its stderr on the terminal: outside a checkout every eval printed "fatal: not
    a git repository". Under run_tasks the lookup reads .git's files (the unit tier fails any started program)."""
    from lm_eval import evaluator

    from trainctl.train import harness

    original = evaluator.get_git_commit_hash
    monkeypatch.chdir(tmp_path)
    with harness.git_hash_from_files():
        assert evaluator.get_git_commit_hash() is None  # not a checkout: no commit, and nothing printed
        (tmp_path / ".git" / "refs" / "heads").mkdir(parents=True)
        (tmp_path / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
        (tmp_path / ".git" / "refs" / "heads" / "main").write_text("0123abc\n")
        assert evaluator.get_git_commit_hash() == "0123abc"
    assert evaluator.get_git_commit_hash is original
    assert capfd.readouterr().err == ""
