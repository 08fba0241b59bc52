"""Fixtures of the CUDA tests: the same stdlib token cache the torchrun tests use."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data-cache")
