"""Errors a user can cause in their configuration."""

from __future__ import annotations

from trainctl.core.errors import UserError


class ConfigError(UserError):
    """One or more configuration problems, each a complete one-line message."""
