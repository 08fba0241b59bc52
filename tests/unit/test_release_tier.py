"""tests/release_tier.txt (the tests scripts/test_torch.sh runs under the oldest supported torch) names only tests
that exist: a renamed test or case would otherwise drop out of that tier, or stop it, only in CI's last stages."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
LINES = [line for line in (REPO / "tests" / "release_tier.txt").read_text().splitlines()
         if line.strip() and not line.startswith("#")]


def test_the_tier_is_not_empty_and_has_no_repeats():
    assert len(LINES) >= 5 and len(set(LINES)) == len(LINES)


@pytest.mark.parametrize("node", LINES)
def test_each_line_names_a_test_that_exists(node):
    path, _, rest = node.partition("::")
    source = (REPO / path).read_text()
    if not rest:
        return
    function, _, case = rest.partition("[")
    assert re.search(rf"^def {re.escape(function)}\(", source, re.M), f"{path} has no {function}"
    for part in filter(None, case.rstrip("]").split("-")):
        assert f'"{part}"' in source or f"'{part}'" in source, f"{path}: no case {part!r} for {function}"
