"""trainctl.api, as a notebook uses it: values in, values out, user errors raised, nothing printed.

A real run launched through the API and watched with api.status is in tests/dist/test_api_launch.py.
"""

from __future__ import annotations

import pytest

from trainctl import api
from trainctl.core.errors import UserError

TINY = ["recipe=tiny_cpu", "train.steps=3", "schedule.warmup_steps=1"]


def test_plan_returns_the_plan_and_prints_nothing(capsys):
    run_plan = api.plan(TINY)
    assert run_plan.to_dict()["world_size"] == 2
    assert api.plan_record(api.resolved(TINY))["launch_command"]
    assert capsys.readouterr() == ("", "")


def test_a_dry_run_launch_then_runs_and_status_return_values_and_print_nothing(tmp_path, capsys):
    handle = api.launch([*TINY, f"runs_dir={tmp_path}"], dry_run=True, name="probe")
    assert (handle.name, handle.backend, handle.exit_code) == ("probe", "local", None)
    assert handle.run_dir.parent.resolve() == tmp_path.resolve() and (handle.run_dir / "launch.sh").is_file()
    assert handle.message.startswith("bash ") and handle.message.endswith("launch.sh")
    infos = api.runs(tmp_path)
    assert [(i.name, i.state.state, i.done) for i in infos] == [("probe", "NOT_STARTED", True)]
    info = api.status("probe", tmp_path)
    record = info.to_dict()
    assert (record["name"], record["state"], record["active"], record["steps"]) == ("probe", "NOT_STARTED", False, 3)
    assert record["log"] == str(info.log) and "eta_s" not in record
    assert capsys.readouterr() == ("", "")


def test_user_errors_are_raised_with_their_lines_not_printed(tmp_path, capsys):
    with pytest.raises(UserError, match="several values"):
        api.launch([*TINY, f"runs_dir={tmp_path}", "optim.lr=1e-3,1e-4"])
    with pytest.raises(UserError, match="no run 'nope'"):
        api.status("nope", tmp_path)
    prepared = api.prepare_launch([*TINY, f"runs_dir={tmp_path}"], dry_run=True, name="dry")
    with pytest.raises(UserError, match="written by a dry run; start it with bash"):
        api.start(prepared)
    with pytest.raises(UserError, match="--dtype int4: not an export dtype"):
        api.export(prepared.run_dir, dtype="int4")
    assert [i.name for i in api.runs(tmp_path)] == ["dry"]  # the refused launch wrote nothing
    assert capsys.readouterr() == ("", "")


def test_a_prepared_sweep_and_its_ranking_are_values(tmp_path, capsys):
    prepared = api.prepare_sweep([*TINY, f"runs_dir={tmp_path}", "optim.lr=1e-3,1e-4"], dry_run=True, name="s")
    assert [d.parent.resolve() for d in prepared.run_dirs] == [tmp_path.resolve()] * 2
    assert prepared.varied == [["optim.lr=0.001"], ["optim.lr=0.0001"]]
    ranking = api.sweep_runs("s", tmp_path)
    assert (ranking.name, len(ranking.rows)) == ("s", 2)
    assert {r["state"] for r in ranking.rows} == {"NOT_STARTED"}
    assert capsys.readouterr() == ("", "")


def test_a_shadowing_config_folder_is_a_note_returned_not_printed(tmp_path, capsys):
    from trainctl.config.sources import shipped_recipes_dir

    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "tiny_cpu.yaml").write_text((shipped_recipes_dir() / "tiny_cpu.yaml").read_text())
    sp = api.search([tmp_path])
    assert [n for n in api.shadow_notes(sp) if "recipe tiny_cpu" in n and str(tmp_path) in n]
    assert api.resolved(TINY, sp).train.steps == 3
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize("call", [
    lambda o: api.plan(o), lambda o: api.launch(o, dry_run=True), lambda o: api.sweep(o),
    lambda o: api.runs(overrides=o), lambda o: api.resume("nowhere", o),
])
def test_overrides_given_as_one_string_are_refused_not_read_letter_by_letter(call, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as err:
        call("recipe=tiny_cpu train.steps=3")
    assert err.value.problems == ["overrides='recipe=tiny_cpu train.steps=3': give a list of strings, one override "
                                  "each (e.g. ['recipe=tiny_cpu', 'train.steps=3']), not one string"]
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_an_override_that_is_not_a_string_is_named():
    with pytest.raises(UserError) as err:
        api.plan(["recipe=tiny_cpu", 3, None])
    assert err.value.problems == ["overrides[1]=3: expected a string, not int",
                                  "overrides[2]=None: expected a string, not NoneType"]
    assert api.plan(("recipe=tiny_cpu",)).world_size == 2  # any sequence of strings is fine (tiny_cpu: 2 workers)
