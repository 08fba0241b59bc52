"""The one base of every error a user can fix on the launcher side.

Config, plan, launch and export errors all derive from `UserError`, so the CLI catches
one class in one place and prints each problem on its own line (exit 2). The worker
keeps its own error (train/errors.py) for what only the live world reveals.
"""

from __future__ import annotations

from collections.abc import Iterable


class UserError(Exception):
    """One or more problems the user can fix, each a complete one-line message.

    Takes one message or a list of them; `str()` is the lines joined by newlines.
    """

    def __init__(self, problems: str | Iterable[str]):
        # One message is the common case at a raise site; a list carries every problem found at once.
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))
