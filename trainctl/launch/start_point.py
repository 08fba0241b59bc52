"""Before a launch or a resume: is the checkpoint it starts from one of the model the config describes?

Torch-free: the checkpoint's meta.json keeps what model it holds (core/model_record.py). The worker checks the
same (train/checkpoint/resume.py, also for checkpoints saved before the record); here it is one line and exit 2
before anything starts. Only committed checkpoints are read (their record, not their bytes: the worker
verifies them).
"""

from __future__ import annotations

from pathlib import Path

from trainctl.config.schema import RunConfig
from trainctl.core import checkpoints, model_record, rundir

OWN_FIX = model_record.RESUME_FIX.format(config=rundir.CONFIG)


def saved_record(ckpt: Path) -> dict | None:
    return rundir.read_json(ckpt / checkpoints.META).get(model_record.KEY)


def newest_committed(run_dir: Path) -> Path | None:
    committed = checkpoints.list_committed(checkpoints.checkpoint_dir(run_dir))
    return committed[-1][1] if committed else None


def own_problems(run_dir: Path, cfg: RunConfig) -> list[str]:
    """A resume of `run_dir` from its newest checkpoint under `cfg` (its config.yaml, perhaps edited since)."""
    ckpt = newest_committed(run_dir)
    if ckpt is None:
        return source_problems(cfg)
    line = model_record.refusal(f"{run_dir / rundir.CONFIG}: the newest checkpoint {ckpt.name}", saved_record(ckpt),
                                cfg.model, OWN_FIX)
    return [line] if line else []


def source_problems(cfg: RunConfig) -> list[str]:
    """A new run starting from checkpoint.resume=PATH (another run's checkpoint, or run directory)."""
    c = cfg.checkpoint
    if c.resume in ("auto", "never", ""):
        return []
    source = Path(c.resume).expanduser()
    ckpt = source if (source / checkpoints.META).is_file() else newest_committed(source)
    if ckpt is None:  # the worker says there is none, in its words
        return []
    saved = saved_record(ckpt)
    if c.load_only == "all":
        line = model_record.refusal(f"checkpoint.resume={c.resume}", saved, cfg.model, OWN_FIX)
        return [line] if line else []
    rank = model_record.saved_lora_rank(saved)
    return [model_record.lora_left_behind(c.resume, rank)] if rank and cfg.model.lora.rank == 0 else []
