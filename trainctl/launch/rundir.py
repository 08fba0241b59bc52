"""The run directory: everything a run needs and records, written before it starts.

    runs/<name>/
      config.yaml     the resolved config; the only input of the workers
      plan.json       the run plan, launch command included
      launch.sh       the exact launch: a bash script (local) or an sbatch script (slurm)
      overrides.txt   the user's command-line overrides, one per line
      code.json       git sha, branch, dirty flag of the trainctl checkout
      code.diff       `git diff HEAD`, only when the checkout is dirty
      logs/           empty; the workers and torchrun write here

An existing run is never overwritten: the name is reserved with an exclusive
mkdir, adding -1, -2, ... on collision. The content is written into a hidden
temporary directory next to it and renamed over the (empty) reserved one, so
no run directory is ever seen half-written; on failure both are removed.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from datetime import datetime
from pathlib import Path

from trainctl.config.schema import RunConfig, to_yaml
from trainctl.launch import code_record, local, slurm
from trainctl.launch.errors import LaunchError
from trainctl.plan.plan import RunPlan, with_run_dir

MAX_SUFFIX = 10_000  # far more collisions than any real use; beyond it something is wrong


def default_name(cfg: RunConfig, now: datetime | None = None) -> str:
    """`<recipe or model name>-<YYYYmmdd-HHMMSS>`."""
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    return f"{cfg.recipe or cfg.model.name}-{stamp}"


def check_name(name: str) -> None:
    """A run name must be one plain path component (it becomes a directory under runs_dir)."""
    # Whitespace too: the name lands in #SBATCH lines and script comments, where a newline would start a command.
    if not name or any(c in name for c in "/\\\0") or any(c.isspace() or not c.isprintable() for c in name) or name.startswith("."):
        raise LaunchError(f"run name {name!r} is not a plain directory name; use letters, digits, '-', '_' (no '/', no spaces, not starting with '.')")


def reserve(runs_dir: Path, base: str) -> Path:
    """Create and return an empty, new directory `base`, `base-1`, `base-2`, ...; never an existing one."""
    for i in range(MAX_SUFFIX):
        candidate = runs_dir / (base if i == 0 else f"{base}-{i}")
        try:
            candidate.mkdir(exist_ok=False)
        except FileExistsError:
            continue
        return candidate
    raise LaunchError(f"{runs_dir} already holds {MAX_SUFFIX} runs named {base}[-N]; choose another name")


def launch_script(cfg: RunConfig, run_dir: Path, workdir: Path) -> str:
    if cfg.cluster.launcher == "slurm":
        return slurm.render_sbatch(cfg, run_dir, workdir)
    return local.render_script(cfg.cluster, run_dir, workdir)


def write_contents(target: Path, cfg: RunConfig, plan: RunPlan, run_dir: Path, overrides: list[str], workdir: Path) -> None:
    """Write every file of the run into `target`; paths inside them refer to the final `run_dir`."""
    (target / "config.yaml").write_text(to_yaml(cfg))
    (target / "plan.json").write_text(json.dumps(with_run_dir(plan, cfg.cluster, run_dir).to_dict(), indent=2) + "\n")
    script = target / "launch.sh"
    script.write_text(launch_script(cfg, run_dir, workdir))
    script.chmod(0o755)
    (target / "overrides.txt").write_text("".join(f"{o}\n" for o in overrides))
    code = code_record.record()
    (target / "code.json").write_text(json.dumps(code.to_dict(), indent=2) + "\n")
    if code.diff:
        (target / "code.diff").write_text(code.diff)
    (target / "logs").mkdir()


def create(
    cfg: RunConfig,
    plan: RunPlan,
    runs_dir: Path,
    name: str | None = None,
    overrides: list[str] | None = None,
    workdir: Path | None = None,
) -> Path:
    """Write a new run directory under `runs_dir` and return its absolute path.

    `name` defaults to cfg.name, then to `default_name`; `workdir` (default: the
    current directory) is where the launch script `cd`s so relative paths in the
    config mean what they meant here.
    """
    base = name or cfg.name or default_name(cfg)
    check_name(base)
    runs_dir = Path(runs_dir).resolve()
    runs_dir.mkdir(parents=True, exist_ok=True)
    run_dir = reserve(runs_dir, base)
    tmp = Path(tempfile.mkdtemp(prefix=f".{run_dir.name}.", suffix=".tmp", dir=runs_dir))
    try:
        os.chmod(tmp, run_dir.stat().st_mode & 0o7777)  # mkdtemp's 0700 would hide the run from others
        write_contents(tmp, cfg, plan, run_dir, list(overrides or []), workdir or Path.cwd())
        # rename(2) atomically replaces an empty directory, and only we know the reserved one.
        os.rename(tmp, run_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        run_dir.rmdir()
        raise
    return run_dir
