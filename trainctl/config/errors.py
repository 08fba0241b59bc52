"""Errors a user can cause in their configuration."""

from __future__ import annotations

import re
from collections.abc import Iterable

from trainctl.core.errors import UserError

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class ConfigError(UserError):
    """One or more configuration problems, each a complete one-line message.

    A line quotes what the user wrote (a value, a key, a file's text); a newline or another control
    character in it is written escaped (\\n), so that each problem stays one line on the terminal.
    """

    def __init__(self, problems: str | Iterable[str]):
        lines = [problems] if isinstance(problems, str) else list(problems)
        super().__init__([_CONTROL.sub(lambda m: repr(m.group())[1:-1], line) for line in lines])


class ConfigFileError(ConfigError, ValueError):
    """A config file that cannot be read as one (syntax, size, aliases, not a mapping), its lines naming it.

    Also a ValueError: readers of a run's config.yaml that report a damaged file catch ValueError.
    """
