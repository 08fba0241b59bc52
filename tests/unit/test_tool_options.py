"""The options of export, generate and eval, declared once (core/tool_options.py): the CLI's options are derived
from them, the api refuses bad values in one line each before any child starts (the unit tier fails a test that
starts a process), and the child reads exactly what the api sent."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest
from typer.main import get_command

from trainctl import api
from trainctl.cli import app
from trainctl.core.errors import UserError
from trainctl.core.tool_options import (
    EvalOptions,
    EvalResult,
    ExportOptions,
    ExportReport,
    Generated,
    GenerateOptions,
    child_argv,
    declared,
    parse_size,
    read_child_argv,
)

TOOLS = {"export": ExportOptions, "generate": GenerateOptions, "eval": EvalOptions}


@pytest.mark.parametrize("command", sorted(TOOLS))
def test_the_clis_options_are_the_declared_ones(command):
    """Every declared option is the command's, with its flag, default and help; the CLI adds only --json and
    --runs-dir."""
    params = {p.name: p for p in get_command(app).commands[command].params}
    for option in declared(TOOLS[command]):
        param = params.pop(option.name)
        assert param.opts == [option.flag] and param.help == option.help
        assert param.required or param.default == option.default
    assert sorted(params) == ["as_json", "run", "runs_dir"]


@pytest.mark.parametrize("options, words", [
    (ExportOptions(dtype="int4"), "--dtype int4: not an export dtype; use one of fp32, bf16, fp16"),
    (ExportOptions(merged=True, adapter=True), "--merged and --adapter: pick one"),
    (ExportOptions(out=" "), "--out '': empty"),
    (ExportOptions(max_shard_size="0"), "--max-shard-size=0: expected a positive number of bytes"),
    (GenerateOptions(), "no prompt: give exactly one of --prompt TEXT"),
    (GenerateOptions(prompt="a", prompt_ids="1"), "--prompt and --prompt-ids: give exactly one"),
    (GenerateOptions(prompt="a", max_new_tokens=0), "--max-new-tokens 0: must be at least 1"),
    (GenerateOptions(prompt="a", temperature=-1.0), "--temperature -1.0: must be a finite number >= 0"),
    (GenerateOptions(prompt="a", temperature=float("inf")), "--temperature inf: must be a finite number >= 0"),
    (GenerateOptions(prompt="a", top_p=0.0), "--top-p 0.0: must be in (0, 1]"),
    (GenerateOptions(prompt_ids="1", chat=True), "--chat with --prompt-ids"),
    (EvalOptions(data="tok", batches=0), "--batches 0: must be at least 1"),
])
def test_a_bad_value_is_one_line_naming_the_option(options, words):
    assert len(options.problems()) == 1 and options.problems()[0].startswith(words), options.problems()


def test_good_values_have_no_problem():
    assert ExportOptions(max_shard_size="2GiB", dtype="bf16").problems() == []
    assert ExportOptions(max_shard_size="2GiB").shard_bytes == 2 * 2**30
    assert GenerateOptions(prompt="a", temperature=0.7, top_p=0.9).problems() == []
    assert EvalOptions(data="tok").problems() == []


@pytest.mark.parametrize("call", [
    lambda run: api.export(run, dtype="int4"),
    lambda run: api.generate(run, prompt="a", top_p=2.0),
    lambda run: api.evaluate(run, data="tok", batches=-1),
])
def test_the_api_refuses_bad_values_before_it_looks_for_the_run_or_starts_a_child(call, tmp_path, capsys):
    with pytest.raises(UserError):
        call(tmp_path / "no-such-run")  # a bad value is named first: the run is not even looked up
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize("options", [ExportOptions(out="x", dtype="bf16", verify=True),
                                     GenerateOptions(prompt="é\nb", seed=3, top_p=0.5), EvalOptions(data="tok")])
def test_the_child_reads_what_the_api_sends(options, tmp_path):
    argv = child_argv("trainctl.some.tool", tmp_path / "run", options, tmp_path / "answer.json")
    # the tool's module through core/lean_process.py, which hands it the rest
    assert argv[1:4] == ["-m", "trainctl.core.lean_process", "trainctl.some.tool"]
    assert read_child_argv(type(options), argv[4:]) == (tmp_path / "run", options, tmp_path / "answer.json")


def test_results_render_as_the_commands_print_them():
    report = ExportReport("out", ["config.json", "model.safetensors"], None, 5)
    assert report.text() == "exported step 5 to out: config.json, model.safetensors"
    assert ExportReport("a", ["adapter_config.json"]).text() == "exported the adapters to a: adapter_config.json"
    one = Generated.from_dict({"completions": [{"prompt": "p", "completion": "c d", "ids": [1, 2]}]})
    assert one.text() == "c d"
    lines = Generated(one.completions * 2, from_file=True).text().splitlines()
    assert [json.loads(line) for line in lines] == [{"prompt": "p", "completion": "c d", "ids": [1, 2]}] * 2
    result = EvalResult(1.5, 4.4817, 1024, 2, 64, 8, 7, "ckpt", "tok")
    assert result.text() == "step 7: val loss 1.5000, perplexity 4.482 over 1,024 tokens (2 batches of 8 x 64) of tok"
    assert [f.name for f in fields(EvalResult)][:3] == ["loss", "perplexity", "tokens"]
    full = EvalResult(1.5, 4.4817, 1023, 2, 64, 8, 7, "ckpt", "tok", split_tokens=1024, full_pass=True,
                      note="--batches 9 holds more than the split's 16 windows of 64 tokens: one full pass (2 batches)")
    assert full.text().splitlines() == [full.note, "step 7: val loss 1.5000, perplexity 4.482 over 1,023 tokens (one "
                                        "full pass over the val split's 1,024 tokens; 2 batches of 8 x 64) of tok"]
    drawn = EvalResult(1.5, 4.4817, 1024, 2, 64, 8, 7, "ckpt", "tok", positions=900, split_tokens=5000)
    assert "(windows covering 900 distinct of the split's 5,000 tokens; 2 batches" in drawn.text()
    tasks = EvalResult(None, None, 0, 0, 64, 8, 7, "ckpt", None, tasks={"qa": {"acc": 0.5, "n": 3}}, tasks_file="f")
    assert tasks.text() == "step 7: qa: acc 0.5000, n 3\nwrote f"


@pytest.mark.parametrize("text, size",
                         [("5000000000", 5 * 10**9), ("500MB", 5 * 10**8), ("2GiB", 2 * 2**30), ("7 kb", 7000)])
def test_parse_size(text, size):
    assert parse_size(text) == size
