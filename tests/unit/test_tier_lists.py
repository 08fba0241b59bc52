"""The tier lists name only tests that exist: tests/release_tier.txt (what scripts/test_torch.sh runs under the oldest
supported torch), tests/extended_tier.txt (what ./scripts/test.sh leaves to --full) and tests/component_tier.txt
(the in-process tests too slow for `-m unit`). A renamed test or case would otherwise drop out of the first, or
stop it, only in CI's last stages, silently move from the second into the default run, or from the third back
into the fast loop. tests/longest_first.txt (the order of the tests that start programs) names whole files and docs
pages that exist, each once: a stale line would only cost the two workers' balance, silently."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import COMPONENT_TIER, EXTENDED_TIER, LONGEST_FIRST, is_listed, tier_lines

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
LISTS = {"release": REPO / "tests" / "release_tier.txt", "extended": EXTENDED_TIER, "component": COMPONENT_TIER}
NODES = [(name, line) for name, path in LISTS.items() for line in tier_lines(path)]


@pytest.mark.parametrize("name", LISTS)
def test_each_list_is_not_empty_and_has_no_repeats(name):
    lines = tier_lines(LISTS[name])
    assert len(lines) >= 5 and len(set(lines)) == len(lines)


@pytest.mark.parametrize(("name", "node"), NODES)
def test_each_line_names_a_test_that_exists(name, node):
    path, _, rest = node.partition("::")
    source = (REPO / path).read_text()
    if not rest:
        return
    function, _, case = rest.partition("[")
    assert re.search(rf"^def {re.escape(function)}\(", source, re.M), f"{name}: {path} has no {function}"
    parts = case.rstrip("]").split("-") if case else []
    assert spelt(parts, source), f"{name}: {path}: no case {case.rstrip(']')!r} for {function}"


def spelt(parts: list[str], source: str) -> bool:
    """Whether a case id's dash-separated parts are parameter ids quoted in the source, one id spanning several parts
    where it has dashes of its own ("lora-fsdp2")."""
    return not parts or any(quoted("-".join(parts[:n]), source) and spelt(parts[n:], source)
                            for n in range(len(parts), 0, -1))


def quoted(value: str, source: str) -> bool:
    """A parameter id in the source: a string literal, an integer in a list or tuple, or a word between two fields
    of an f-string id (`f"{n}-from-{lay}"`)."""
    number = value.isdigit() and re.search(rf"[\[(, ]{value}[,\])]", source)
    return f'"{value}"' in source or f"'{value}'" in source or f"}}-{value}-{{" in source or bool(number)


@pytest.mark.parametrize(("parts", "ok"), [(["loss", "lora-fsdp2"], True), (["loss", "lora", "fsdp2"], True),
                                           (["loss", "fsdp3"], False), ([], True),
                                           (["loss", "6"], True), (["loss", "7"], False),
                                           (["lora", "from", "loss"], True)])
def test_a_case_id_may_span_dashes(parts, ok):
    source = 'x = ["loss"]; y = ["lora-fsdp2"]; z = ("lora", "fsdp2"); seeds = [0, 6]; n = 17; id = f"{a}-from-{b}"'
    assert spelt(parts, source) is ok


DOCS_PAGE = re.compile(r"^tests/dist/test_docs_blocks\.py::test_the_pages_blocks_run_as_written"
                       r"\[(?P<page>[\w.-]+\.md)\]$")


def test_the_longest_first_list_names_whole_files_and_docs_pages_that_exist_once():
    lines = tier_lines(LONGEST_FIRST)
    assert len(lines) >= 5 and len(set(lines)) == len(lines)
    for line in lines:
        if page := DOCS_PAGE.match(line):
            name = page["page"]
            assert (REPO / name).is_file() if name == "README.md" else (REPO / "docs" / name).is_file(), line
        else:
            assert "::" not in line and (REPO / line).is_file(), f"{line}: not a test file (a module stays whole)"


def test_the_extended_list_never_names_a_whole_file_of_the_default_run():
    """Each listed case is another case of a proof the default run makes: a whole file listed would take its proof
    out of CI."""
    assert [line for line in tier_lines(EXTENDED_TIER) if "::" not in line] == []


def test_the_component_list_names_only_in_process_folders():
    """A component test runs in process, beside the unit tier: a torchrun or Slurm test listed there would be refused
    a process by the in-process guard, and leave its own tier."""
    assert [line for line in tier_lines(COMPONENT_TIER) if not line.startswith("tests/unit/")] == []


@pytest.mark.parametrize(("nodeid", "listed"), [
    ("tests/dist/a.py::test_f[x-y]", True),   # the case itself
    ("tests/dist/a.py::test_f[z]", True),     # another case of a listed function
    ("tests/dist/a.py::test_g", False),       # another function of the file
    ("tests/dist/b.py::test_h[x-y]", True),   # a listed file
    ("tests/dist/a.py::test_f2", False),      # a function whose name starts like a listed one
    ("tests/dist/c.py::test_k[x]", False),    # a listed case of another parameter
])
def test_a_line_names_its_file_its_function_or_exactly_its_case(nodeid, listed):
    lines = ["tests/dist/a.py::test_f", "tests/dist/b.py", "tests/dist/c.py::test_k[x-y]"]
    assert is_listed(nodeid, lines) is listed
