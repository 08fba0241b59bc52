"""`generate --prompts FILE` answers every line (issue 35): a line that cannot be answered gets its reason, with
its line number, in its own JSON line; the lines around it still get their completions."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests.helpers import cli_in_process, make_run
from trainctl.core.tool_options import Completion, Generated, GenerateOptions
from trainctl.models.generate import GenerateError, Sampling, _checked_prompt, read_prompts


class Bytes:
    """Text to its UTF-8 bytes, as the byte tokenizer encodes it."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


MODEL = SimpleNamespace(vocab_size=256, max_seq_len=16)
SAMPLING = Sampling(4, 0.0, 1.0, 0)


def test_each_prompt_is_labelled_with_its_line(tmp_path):
    file = tmp_path / "p.txt"
    file.write_text("first\n\n   \nthird\n")
    assert read_prompts(file) == [(f"--prompts {file} line 1", "first"), (f"--prompts {file} line 4", "third")]


def test_a_line_that_cannot_be_answered_is_its_reason_not_the_end_of_the_file(tmp_path):
    options = GenerateOptions(prompts=str(tmp_path / "p.txt"))
    ids, fit = _checked_prompt("--prompts p.txt line 1", "hi", Bytes(), options, SAMPLING, MODEL)
    assert ids == [104, 105] and fit.max_new_tokens == 4
    too_long = _checked_prompt("--prompts p.txt line 2", "x" * 20, Bytes(), options, SAMPLING, MODEL)
    assert isinstance(too_long, GenerateError)
    assert str(too_long) == ("--prompts p.txt line 2: 20 tokens, no room for a new one within model.max_seq_len=16; "
                             "shorten the prompt")
    past_vocab = _checked_prompt("--prompts p.txt line 3", "é", Bytes(), options, SAMPLING,
                                 SimpleNamespace(vocab_size=128, max_seq_len=16))
    assert str(past_vocab).startswith("--prompts p.txt line 3: the run's tokenizer: token id 195 >= model.vocab_size")


def test_the_json_lines_carry_an_error_only_where_there_is_one():
    out = Generated([Completion("a", "b", [98]), Completion("x", "", [], error="line 2: no room")], from_file=True)
    assert [json.loads(line) for line in out.text().splitlines()] == [
        {"prompt": "a", "completion": "b", "ids": [98]},
        {"prompt": "x", "completion": "", "ids": [], "error": "line 2: no room"}]
    assert Generated.from_dict({"completions": [{"prompt": "x", "completion": "", "ids": [], "error": "e"}],
                                "from_file": True}).completions[0].error == "e"


@pytest.mark.parametrize("errors, code", [((None, None), 0), ((None, "line 2: no room"), 1)])
def test_generate_exits_1_once_every_line_is_printed_when_a_line_failed(tmp_path, monkeypatch, capsys, errors,
                                                                         code):
    """The child's answer (its JSON value) stands in for the torch child: what the CLI prints and how it exits."""
    run_dir = make_run(tmp_path / "runs", "ft")
    (tmp_path / "p.txt").write_text("a\nb\n")
    answer = {"completions": [{"prompt": p, "completion": "" if e else "ok", "ids": [], "error": e}
                              for p, e in zip("ab", errors, strict=True)], "from_file": True}
    monkeypatch.setattr("trainctl.api.tools._run_child", lambda module, run, options: answer)
    for json_flag in ([], ["--json"]):
        got, out, _ = cli_in_process(monkeypatch, capsys, "generate", str(run_dir), "--prompts",
                                     str(tmp_path / "p.txt"), *json_flag)
        assert got == code
        printed = json.loads(out)["completions"] if json_flag else [json.loads(line) for line in out.splitlines()]
        assert [c["prompt"] for c in printed] == ["a", "b"]  # every line, the failed one included
