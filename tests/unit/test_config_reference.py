"""docs/config-reference.md is generated from the schema (scripts/config_reference.py): the committed page must be
exactly what the script renders now, so a key added, removed or re-commented without regenerating fails here."""

from __future__ import annotations

import dataclasses
import importlib.util
import typing

from tests.helpers import REPO
from trainctl.config import schema


def _script():
    spec = importlib.util.spec_from_file_location("config_reference", REPO / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_reference_is_what_the_schema_renders():
    assert (REPO / "docs" / "config-reference.md").read_text() == _script().render(), (
        "docs/config-reference.md is out of date: run python scripts/config_reference.py")


def test_every_key_of_every_group_and_backend_has_a_row():
    text = _script().render()

    def keys(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f"{prefix}.{f.name}" if prefix else f.name
            if dataclasses.is_dataclass(hints[f.name]):
                yield from keys(hints[f.name], key)
            else:
                yield key

    expected = set(keys(schema.RunConfig, ""))
    for cls in schema.cluster_configs().values():
        expected |= set(keys(cls, "cluster"))
    missing = [k for k in sorted(expected) if f"| `{k}` |" not in text]
    assert not missing, missing
    assert "| `cluster.container.image` |" in text and "| `cluster.preemption.signal` |" in text


def test_a_field_comment_becomes_its_description():
    @dataclasses.dataclass
    class Probe:
        # above the field,
        # over two lines
        a: int = 1
        b: str = "x"  # beside it
        c: bool = False

    notes = _script().field_comments(Probe)
    assert notes == {"a": "above the field, over two lines", "b": "beside it", "c": ""}


def test_check_mode_fails_on_a_stale_page(tmp_path, monkeypatch):
    module = _script()
    stale = tmp_path / "config-reference.md"
    stale.write_text("# old\n")
    monkeypatch.setattr(module, "TARGET", stale)
    monkeypatch.setattr(module, "REPO", tmp_path)
    assert module.main(["--check"]) == 1
    assert module.main([]) == 0 and module.main(["--check"]) == 0
