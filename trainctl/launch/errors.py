"""Errors a user can cause when starting a run."""

from __future__ import annotations


class LaunchError(Exception):
    """The run cannot be started as configured; the message says what would work."""
