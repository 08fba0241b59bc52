"""Fixtures shared by the torchrun tests (helpers live in worker_runs.py)."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One stdlib token cache for every run of the session (built once by the first worker)."""
    return tmp_path_factory.mktemp("data-cache")
