"""Errors a user can cause in their configuration."""

from __future__ import annotations

from trainctl.core.errors import UserError


class ConfigError(UserError):
    """One or more configuration problems, each a complete one-line message."""


class ConfigFileError(ConfigError, ValueError):
    """A config file that cannot be read as one (syntax, size, aliases, not a mapping), its lines naming it.

    Also a ValueError: readers of a run's config.yaml that report a damaged file catch ValueError.
    """
