"""The test suite's two workers keep a group together: scripts/test.sh runs its torchrun tests with `-n 2 --dist
loadgroup`, and tests/conftest.py marks each module that shares runs (and the Slurm tests, one cluster) with an
xdist_group while collecting. pytest-xdist turns that marker into the node id's @group suffix it schedules by; with
pytest 9.2 (node ids no longer read from Node._nodeid) the suffix silently vanished, each test went its own way, a
module's runs trained on both workers and the Slurm cluster was brought up twice at once. Here a module fixture
that records each setup, marked the way the conftest marks, must run once, its tests on one worker."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.cli

pytest.importorskip("xdist")

CONFTEST = '''
import pytest

@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if "shared" in item.fixturenames:
            item.add_marker(pytest.mark.xdist_group("shared-runs"))
'''

TESTS = '''
import os
import pytest

@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    with open(os.environ["SETUPS"], "a") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")

@pytest.mark.parametrize("case", range(6))
def test_shared(shared, case):
    with open(os.environ["RAN"], "a") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")

@pytest.mark.parametrize("case", range(6))
def test_alone(case):
    pass
'''


def test_a_marked_group_runs_on_one_worker_and_sets_its_module_fixture_up_once(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_groups.py").write_text(TESTS)
    setups, ran = tmp_path / "setups.txt", tmp_path / "ran.txt"
    env = {"PATH": "/usr/bin:/bin", "SETUPS": str(setups), "RAN": str(ran), "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                           "loadgroup", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(ran.read_text().split()) == 6
    assert len(set(ran.read_text().split())) == 1, "the group's tests ran on both workers"
    assert len(setups.read_text().split()) == 1, "the module fixture was set up once per worker"
