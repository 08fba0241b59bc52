"""The wall: planning and writing a run never imports torch or wandb; the CLI imports Hydra only to compose."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.cli

CHECK = """
import sys
from pathlib import Path
import trainctl.plan.runplan, trainctl.plan.memory
import trainctl.launch.command, trainctl.launch.rundir, trainctl.launch.backends.local, trainctl.launch.backends.slurm
from trainctl.config.schema import RunConfig, TrainConfig
cfg = RunConfig(train=TrainConfig(global_batch=1, micro_batch=1, grad_accum=1))
plan = trainctl.plan.runplan.build(cfg)
trainctl.launch.rundir.create(cfg, plan, Path(sys.argv[1]), "wall", [])
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "wandb"))
print(",".join(heavy))
"""


def test_plan_and_launch_leave_torch_and_wandb_unimported(tmp_path):
    # A fresh interpreter: in this one, other tests may already have imported torch.
    done = subprocess.run([sys.executable, "-c", CHECK, str(tmp_path)], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == ""


READ_ONLY = """
import sys
from trainctl.cli import app  # every command registered: what `trainctl runs` or `status` imports before it runs
print(",".join(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "wandb", "hydra", "omegaconf"))))
"""


def test_the_cli_imports_hydra_only_for_a_command_that_composes():
    # Hydra is about a third of the CLI's start; status, runs, logs, cancel and the tools never compose a config.
    done = subprocess.run([sys.executable, "-c", READ_ONLY], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == ""
