"""Errors a user can cause when starting a run."""

from __future__ import annotations

from trainctl.core.errors import UserError


class LaunchError(UserError):
    """The run cannot be started as configured; the message says what would work."""
