"""The command blocks of the user docs (README.md and docs/*.md), as the docs tests read them.

A fenced block whose info string starts with `bash` is a command block: CI runs it (tests/dist/test_docs_blocks.py),
in page order, every page in a fresh folder. `bash skip-ci: REASON` marks one that cannot run there (a GPU, a real
multi-node cluster, the network); the reason is required. Listings with placeholders are `text` and never run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)
SKIP = "skip-ci:"


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository
    number: int  # 1-based among the page's bash blocks
    line: int  # of the opening fence
    info: str  # the fence's info string after `bash`
    code: str

    @property
    def skip_reason(self) -> str | None:
        """None: CI runs it; else why it cannot (may be "" when the author forgot the reason)."""
        if not self.info.startswith(SKIP):
            return None
        return self.info[len(SKIP):].strip()

    def where(self) -> str:
        return f"{self.page}:{self.line} (bash block {self.number})"


def pages() -> list[Path]:
    """README.md first, then every page of docs/ by name."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def blocks(page: Path) -> list[Block]:
    text, out = page.read_text(), []
    for found in FENCE.finditer(text):
        lang, _, info = found.group(1).strip().partition(" ")
        if lang != "bash":
            continue
        line = text.count("\n", 0, found.start()) + 1
        out.append(Block(str(page.relative_to(REPO)), len(out) + 1, line, info.strip(), found.group(2)))
    return out
