"""A CPU worker's torch threads: cluster.cpu_threads, else the launch's OMP_NUM_THREADS, else its cores shared
among the node's ranks. The launch script keeps a value a user exported on a local run; the worker must not then
take the whole machine per rank (more threads than cores runs many times slower, not a little)."""

from __future__ import annotations

import os

import pytest
import torch

from trainctl.config.schema import ClusterConfig
from trainctl.train.parallel.distributed import omp_threads, oversubscribed, set_cpu_threads


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(("value", "threads"), [("3", 3), (" 2 ", 2), ("4,2", 4), ("0", 0), ("-1", 0),
                                                ("many", 0), ("", 0), (None, 0)])
def test_omp_num_threads_reads_as_a_positive_count_or_nothing(monkeypatch, value, threads):
    if value is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert omp_threads() == threads


def test_cpu_threads_wins_over_the_environment(monkeypatch, restore_threads):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert set_cpu_threads(ClusterConfig(procs_per_node=2, cpu_threads=3), local_world_size=2) == 3
    assert torch.get_num_threads() == 3


def test_the_launchs_omp_num_threads_is_kept(monkeypatch, restore_threads):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert set_cpu_threads(ClusterConfig(procs_per_node=1), local_world_size=1) == 1
    assert torch.get_num_threads() == 1


def test_without_either_the_cores_are_shared_among_the_ranks(monkeypatch, restore_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert set_cpu_threads(ClusterConfig(procs_per_node=2), local_world_size=2) == max(1, cores // 2)
    assert set_cpu_threads(ClusterConfig(procs_per_node=1), local_world_size=cores + 1) == 1


def test_more_threads_than_cores_is_named_in_one_line():
    cores = len(os.sched_getaffinity(0))
    assert oversubscribed(1, cores) is None and oversubscribed(max(1, cores // 2), 2) is None
    warning = oversubscribed(cores, 2)
    assert warning is not None and "\n" not in warning
    assert f"2 rank(s) x {cores} torch threads on {cores} cores" in warning and "cluster.cpu_threads" in warning
