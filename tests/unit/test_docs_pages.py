"""The user docs' shape: a short README that links every page, links that resolve, command blocks that say why when
CI cannot run them, and no word about anything but the product."""

from __future__ import annotations

import re

import pytest

from tests.doc_blocks import REPO, blocks, pages

pytestmark = pytest.mark.unit

README_MAX_LINES = 250
MAX_SKIPPED = 8  # blocks CI cannot run (GPU, real cluster, the suite itself): few, each with its reason
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# Words that speak of how the docs were written instead of the product.
NOT_PRODUCT = re.compile(r"2-core machine|this machine's 2|\bsessions?\b|not yet run|no GPU figures", re.I)
# Pages that come with other changes of the same release (the design page; the GPU tables): checked once present.
PENDING = {"docs/design.md", "benchmarks/h200/README.md"}


def test_the_readme_is_short():
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/"


def test_every_docs_page_is_linked_from_the_readme():
    readme = (REPO / "README.md").read_text()
    missing = [p.name for p in pages()[1:] if f"(docs/{p.name})" not in readme]
    assert not missing, f"README.md links none of: {missing}"


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        path = (page.parent / target).resolve()
        rel = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)
        if not path.exists() and rel not in PENDING:
            broken.append(target)
    assert not broken, f"{page.name}: links to nothing: {broken}"


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_pages_speak_of_the_product_only(page):
    found = [m.group(0) for m in NOT_PRODUCT.finditer(page.read_text())]
    assert not found, f"{page.name}: {found}"


def test_every_skipped_block_says_why_and_they_stay_few():
    all_blocks = [b for p in pages() for b in blocks(p)]
    bad = [b.where() for b in all_blocks if b.info and b.skip_reason is None]
    assert not bad, f"a bash fence takes nothing after `bash` but `skip-ci: REASON`: {bad}"
    unexplained = [b.where() for b in all_blocks if b.skip_reason == ""]
    assert not unexplained, f"skip-ci without a reason: {unexplained}"
    skipped = [b for b in all_blocks if b.skip_reason]
    assert len(skipped) <= MAX_SKIPPED, [b.where() for b in skipped]
    assert len(all_blocks) - len(skipped) >= 10  # the docs are mostly runnable


def test_the_extractor_reads_fences_and_reasons(tmp_path, monkeypatch):
    page = tmp_path / "p.md"
    page.write_text("x\n```bash\necho a\n```\n```text\nnot run\n```\n```bash skip-ci: needs a GPU\nnvidia-smi\n```\n")
    monkeypatch.setattr("tests.doc_blocks.REPO", tmp_path)
    found = blocks(page)
    assert [(b.number, b.line, b.code, b.skip_reason) for b in found] == [
        (1, 2, "echo a\n", None), (2, 8, "nvidia-smi\n", "needs a GPU")]
