"""The Python API checks its arguments' types at its boundary: one UserError line per wrong argument (issue 35).

Every public function is covered by its annotations through one decorator (api/arguments.py); the tests below
hold that no public function lacks it, that each of its parameters is checked, and the cases users hit.
"""

from __future__ import annotations

import inspect

import pytest

from trainctl import api
from trainctl.api import tuning_queued
from trainctl.core.errors import UserError

PUBLIC = sorted({name for name in api.__all__ if inspect.isfunction(getattr(api, name))})
FUNCTIONS = [getattr(api, name) for name in PUBLIC] + [tuning_queued.collect]
TAKING = [f for f in FUNCTIONS if inspect.signature(f).parameters]  # cwd_problem() and env_runs_dir() take none


class Wrong:
    """A value no annotation of the API allows."""

    def __repr__(self) -> str:
        return "Wrong()"


def test_every_public_function_is_checked():
    assert len(PUBLIC) > 30
    assert [f.__name__ for f in FUNCTIONS if not getattr(f, "__api_checked__", False)] == []


@pytest.mark.parametrize("fn", TAKING, ids=lambda f: f.__name__)
def test_every_parameter_of_every_public_function_is_checked(fn, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    with pytest.raises(UserError) as err:
        fn(**{p.name: Wrong() for p in params})
    assert [line.split("=", 1)[0] for line in err.value.problems] == [p.name for p in params]
    assert all(": expected " in line and line.endswith(", not Wrong") for line in err.value.problems)
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("call, line", [
    (lambda: api.plan(config_dirs=5), "config_dirs=5: expected a SearchPath or a list of paths or strings or None"),
    (lambda: api.launch(["recipe=tiny_cpu"], name=5, dry_run=True), "name=5: expected a string, not int"),
    (lambda: api.runs(runs_dir=5), "runs_dir=5: expected a path or a string or None, not int"),
    (lambda: api.prepare_data(["in.txt"], "out", workers="2"), "workers='2': expected an int or None, not str"),
    (lambda: api.tune(["recipe=tiny_cpu"], top="4"), "top='4': expected an int, not str"),
    (lambda: api.launch(["recipe=tiny_cpu"], dry_run="no"), "dry_run='no': expected True or False, not str"),
    (lambda: api.launch(["recipe=tiny_cpu"], dry_run=1), "dry_run=1: expected True or False, not int"),
    (lambda: api.prepare_data("file.jsonl", "out"),
     "inputs='file.jsonl': give a list of strings, one path each (e.g. ['file.jsonl']), not one string"),
    (lambda: api.plot("run-a"), "runs='run-a': give a list of strings, one run each (e.g. ['run-a']), not one string"),
    (lambda: api.prepare_data(["in.txt"], "out", wrkers=2), "wrkers=2: not an option of api.prepare_data; use one"),
    (lambda: api.generate("run", max_new_tokens="8"), "max_new_tokens='8': expected an int, not str"),
    (lambda: api.export("run", dtyp="bf16"), "dtyp='bf16': not an option of api.export; use one of: adapter"),
    (lambda: api.status("run", "runs", "extra"), "api.status: too many positional arguments"),
])
def test_the_wrong_types_users_pass_are_one_line_each(call, line, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as err:
        call()
    assert len(err.value.problems) == 1 and err.value.problems[0].startswith(line)
    assert list(tmp_path.iterdir()) == []


def test_what_the_annotations_allow_still_passes(tmp_path):
    from pathlib import Path

    assert api.runs(runs_dir=tmp_path) == [] and api.runs(runs_dir=str(tmp_path)) == []
    assert api.plan(("recipe=tiny_cpu",), [Path(tmp_path)]).world_size == 2
    assert api.plan(["recipe=tiny_cpu"], api.search([str(tmp_path)])).world_size == 2
