"""checkpoint.resume=PATH from another run: whether its optimizer state can load into this run's optimizer.

A checkpoint's optimizer state is its optimizer's (AdamW's two moments, Lion's one, Muon's momentum): another
optimizer cannot take it. Read from the source run's config.yaml before launch, so the refusal is one line and
nothing starts; checkpoint.load_only=model loads the weights alone and starts the optimizer fresh.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from trainctl.config import schema
from trainctl.core import rundir

CONFIG_LIMIT = 1 << 20  # a run's config.yaml is a few KiB


def source_run_dir(path: Path) -> Path | None:
    """The run directory PATH names: the run itself, or the run of one of its step directories."""
    for candidate in (path, path.parent.parent):
        if (candidate / rundir.CONFIG).is_file():
            return candidate
    return None


def source_optimizer(path: Path) -> str | None:
    """optim.name of the run that wrote the checkpoint; None when its config cannot be read (the worker reports)."""
    run = source_run_dir(path)
    data = rundir.read_bytes(run / rundir.CONFIG, CONFIG_LIMIT) if run else None
    try:
        config = yaml.safe_load(data) if data else None
    except yaml.YAMLError:
        return None
    optim = config.get("optim") if isinstance(config, dict) else None
    name = optim.get("name") if isinstance(optim, dict) else None
    return name if isinstance(name, str) else None


def check_resume_optimizer(c: schema.CheckpointConfig, o: schema.OptimConfig) -> list[str]:
    if c.resume in ("auto", "never", "") or c.load_only == "model":
        return []
    theirs = source_optimizer(Path(c.resume).expanduser())
    if theirs is None or theirs == o.name:
        return []
    return [f"checkpoint.resume={c.resume}: its optimizer state is optim.name={theirs}'s, which optim.name={o.name} "
            f"cannot load; add checkpoint.load_only=model to start the optimizer fresh, or use optim.name={theirs}"]
