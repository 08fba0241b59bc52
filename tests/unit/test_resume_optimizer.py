"""A new run from another run's checkpoint (checkpoint.resume=PATH) with another optimizer: refused in one line
before launch, unless checkpoint.load_only=model starts the optimizer fresh."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from trainctl.config.errors import ConfigError
from trainctl.config.schema import CheckpointConfig, OptimConfig, RunConfig
from trainctl.config.validate import resolve


def source_run(tmp_path: Path, optimizer: str) -> Path:
    run = tmp_path / "old"
    (run / "checkpoints" / "step-00000010").mkdir(parents=True)
    (run / "config.yaml").write_text(f"name: old\noptim:\n  name: {optimizer}\n  lr: 0.001\n")
    return run


def from_checkpoint(path: Path, optimizer: str, load_only: str = "all") -> RunConfig:
    return dataclasses.replace(RunConfig(), optim=OptimConfig(name=optimizer),
                               checkpoint=CheckpointConfig(resume=str(path), load_only=load_only))


@pytest.mark.parametrize("load_only", ["all", "model_optim"])
@pytest.mark.parametrize("step_dir", [False, True])
def test_another_optimizer_than_the_checkpoints_is_one_line(tmp_path, load_only, step_dir):
    run = source_run(tmp_path, "adamw")
    path = run / "checkpoints" / "step-00000010" if step_dir else run
    with pytest.raises(ConfigError) as err:
        resolve(from_checkpoint(path, "lion", load_only))
    (line,) = err.value.problems
    assert line.startswith(f"checkpoint.resume={path}: its optimizer state is optim.name=adamw's")
    assert "checkpoint.load_only=model" in line and "optim.name=lion" in line


def test_the_same_optimizer_or_the_weights_alone_are_accepted(tmp_path):
    run = source_run(tmp_path, "adamw")
    assert resolve(from_checkpoint(run, "adamw")).optim.name == "adamw"
    assert resolve(from_checkpoint(run, "lion", "model")).optim.name == "lion"


def test_an_unreadable_source_config_is_left_to_the_worker(tmp_path):
    run = source_run(tmp_path, "adamw")
    (run / "config.yaml").write_text("optim: [unclosed\n")
    assert resolve(from_checkpoint(run, "lion")).optim.name == "lion"
