"""What a first CUDA run needs, checked on CPU: the allocator setting, the compile toolchain check,
Python's garbage collector at a fixed interval, and train.gc_every's validation."""

from __future__ import annotations

import dataclasses
import gc
import os
import sysconfig

import pytest

from trainctl.config.errors import ConfigError
from trainctl.config.schema import RunConfig
from trainctl.config.validate import resolve
from trainctl.train import __main__ as worker_main
from trainctl.train import rank_process
from trainctl.train.errors import WorkerConfigError
from trainctl.train.loop import gc_schedule
from trainctl.train.parallel import parallelize


def test_workers_get_expandable_segments_unless_the_user_configured_the_allocator(monkeypatch):
    env: dict = {}
    rank_process.allocator_defaults(env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for name in rank_process.ALLOC_CONF_ENVS:
        mine = {name: "max_split_size_mb:512"}
        rank_process.allocator_defaults(mine)
        assert mine == {name: "max_split_size_mb:512"}
    # main sets it first thing, before anything imports torch.
    for name in rank_process.ALLOC_CONF_ENVS:
        monkeypatch.setenv(name, "")  # empty counts as unset; monkeypatch restores the variables afterwards
    assert worker_main.main([]) == worker_main.EXIT_CONFIG
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def _toolchain(monkeypatch, tmp_path, compilers: set[str], headers: bool):
    monkeypatch.setattr(parallelize.shutil, "which", lambda name: f"/usr/bin/{name}" if name in compilers else None)
    include = tmp_path / "include"
    include.mkdir(exist_ok=True)
    if headers:
        (include / "Python.h").write_text("")
    paths = {**sysconfig.get_paths(), "include": str(include)}
    monkeypatch.setattr(parallelize.sysconfig, "get_paths", lambda: paths)


@pytest.mark.parametrize("compilers, headers, missing", [
    (set(), True, "a C compiler"),
    ({"gcc"}, False, "Python's headers"),
    (set(), False, "a C compiler (cc, gcc or clang; or $CC) and Python's headers"),
])
def test_compile_without_a_toolchain_is_refused_in_one_line(monkeypatch, tmp_path, compilers, headers, missing):
    _toolchain(monkeypatch, tmp_path, compilers, headers)
    with pytest.raises(WorkerConfigError) as err:
        parallelize.check_compiler({})
    message = str(err.value)
    assert "\n" not in message and message.startswith("train.compile=true") and missing in message
    assert "train.compile=false" in message


def test_compile_with_a_toolchain_passes(monkeypatch, tmp_path):
    _toolchain(monkeypatch, tmp_path, {"cc"}, True)
    parallelize.check_compiler({})
    _toolchain(monkeypatch, tmp_path, {"clang-18"}, True)
    parallelize.check_compiler({"CC": "clang-18 -O2"})  # $CC names the compiler
    with pytest.raises(WorkerConfigError):
        parallelize.check_compiler({"CC": "icx"})  # named but not installed


def test_the_collector_runs_every_n_steps_and_only_then(monkeypatch):
    calls = []
    monkeypatch.setattr(gc_schedule.gc, "collect", lambda generation=2: calls.append(generation))
    assert gc.isenabled()
    with gc_schedule.collect_every(3) as after:
        assert not gc.isenabled()
        for done in range(1, 10):
            after(done)
    assert gc.isenabled()
    assert calls == [2, 1, 1, 1]  # one full collection at the start, then after steps 3, 6 and 9


def test_the_collector_comes_back_when_the_loop_fails():
    with pytest.raises(RuntimeError), gc_schedule.collect_every(5):
        raise RuntimeError("a step failed")
    assert gc.isenabled()


def test_gc_every_zero_leaves_the_collector_alone(monkeypatch):
    calls = []
    monkeypatch.setattr(gc_schedule.gc, "collect", lambda generation=2: calls.append(generation))
    with gc_schedule.collect_every(0) as after:
        assert gc.isenabled()
        after(50)
    assert calls == []


def test_a_negative_gc_interval_is_one_line_naming_the_key():
    cfg = RunConfig()
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, gc_every=-1))
    with pytest.raises(ConfigError) as err:
        resolve(cfg)
    (problem,) = [p for p in err.value.problems if "gc_every" in p]
    assert problem.startswith("train.gc_every") and "0 leaves" in problem
