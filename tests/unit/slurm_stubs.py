"""Kept for importers not yet switched: write_exe lives in tests/helpers.py."""

from tests.helpers import write_exe

__all__ = ["write_exe"]
