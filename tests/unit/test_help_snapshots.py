"""Every command's `--help` against a committed snapshot, so an option cannot appear, vanish or change its default
unnoticed.

Rendered in process (typer.testing.CliRunner) without colour or a terminal, and at a fixed width (click wraps at
80 columns at most; COLUMNS=100 keeps a narrower terminal from changing that), so the text depends on the code
only. After an intended change, regenerate the snapshots and review their diff:

    UPDATE_SNAPSHOTS=1 python -m pytest tests/unit/test_help_snapshots.py
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import typer.rich_utils
from typer.main import get_command
from typer.testing import CliRunner

from trainctl.cli import app

SNAPSHOTS = Path(__file__).parent / "snapshots" / "help"
WIDTH = 100


def command_paths(command, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The root and every command and subcommand under it, as the words that name it."""
    paths = [path]
    children = getattr(command, "commands", {})  # a group (typer ships its own click, so no isinstance)
    for name in sorted(children):
        paths += command_paths(children[name], (*path, name))
    return paths


PATHS = command_paths(get_command(app))


def snapshot_file(path: tuple[str, ...]) -> Path:
    return SNAPSHOTS / f"{'-'.join(('trainctl', *path))}.txt"


def rendered_help(path: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> str:
    # typer reads these from the environment at import time: set them on the module so the run's own terminal,
    # CI's FORCE_COLOR or a TERMINAL_WIDTH cannot change the text.
    monkeypatch.setattr(typer.rich_utils, "MAX_WIDTH", WIDTH)
    monkeypatch.setattr(typer.rich_utils, "FORCE_TERMINAL", False)
    monkeypatch.setattr(typer.rich_utils, "COLOR_SYSTEM", None)
    env = {"COLUMNS": str(WIDTH), "NO_COLOR": "1", "TERM": "dumb", "TERMINAL_WIDTH": str(WIDTH)}
    result = CliRunner().invoke(app, [*path, "--help"], env=env, prog_name="trainctl", color=False)
    assert result.exit_code == 0, result.output
    return "\n".join(line.rstrip() for line in result.output.splitlines()) + "\n"


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "trainctl")
def test_help_matches_its_snapshot(path: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    text, file = rendered_help(path, monkeypatch), snapshot_file(path)
    if os.environ.get("UPDATE_SNAPSHOTS") == "1":
        file.write_text(text)
    assert file.is_file(), f"no snapshot for `trainctl {' '.join(path)} --help`: regenerate (see this module's doc)"
    assert text == file.read_text(), (f"`trainctl {' '.join(path)} --help` differs from {file}; if intended, "
                                      "regenerate (see this module's doc) and review the diff")


def test_every_snapshot_names_a_command() -> None:
    """A removed command's snapshot goes too, so the folder stays the list of what the CLI offers."""
    expected = {snapshot_file(path).name for path in PATHS}
    assert {f.name for f in SNAPSHOTS.glob("*.txt")} == expected


def test_a_vanished_option_fails_the_comparison(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison sees one option less: the snapshot of `export` names --verify, a copy without it differs."""
    text = rendered_help(("export",), monkeypatch)
    assert "--verify" in text
    without = "\n".join(line for line in text.splitlines() if "--verify" not in line) + "\n"
    assert without != snapshot_file(("export",)).read_text()
