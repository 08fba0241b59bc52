"""Helpers of the hostile-config tests (test_config_hostile*.py): a deadline instead of a hang, config folders
written from a dict, and the one line compose refuses with. A module of their own so both test files share them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import deadline
from trainctl.config.compose import compose
from trainctl.config.errors import ConfigError
from trainctl.config.sources import SearchPath


def write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def refused(overrides: list[str], sp: SearchPath = SearchPath()) -> str:
    """The one line compose refuses `overrides` with (within a deadline)."""
    with deadline(20), pytest.raises(ConfigError) as err:
        compose(overrides, sp)
    (line,) = err.value.problems
    assert "\n" not in line
    return line
