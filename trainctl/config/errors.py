"""Errors a user can cause in their configuration."""

from __future__ import annotations


class ConfigError(Exception):
    """One or more configuration problems, each a complete one-line message."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))
