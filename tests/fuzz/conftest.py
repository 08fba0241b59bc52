"""The fuzz tier's temporary folder is its own: `overlays_left` must count only what this process's composing
left behind, not the overlays of other trainctl processes (an older checkout's probes) sharing /tmp."""

from __future__ import annotations

import tempfile

import pytest


@pytest.fixture(autouse=True, scope="session")
def private_tempdir(tmp_path_factory):
    previous = tempfile.tempdir
    tempfile.tempdir = str(tmp_path_factory.mktemp("tmp"))  # what tempfile.gettempdir() and mkdtemp() use
    try:
        yield
    finally:
        tempfile.tempdir = previous
