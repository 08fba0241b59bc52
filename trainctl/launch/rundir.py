"""Writing a new run directory: everything a run needs, before it starts (the layout: trainctl.core.rundir).

An existing run is never overwritten: the name is reserved with an exclusive
mkdir, adding -1, -2, ... on collision. The content is written into a hidden
temporary directory next to it and renamed over the (empty) reserved one, so
no run directory is ever seen half-written; on failure both are removed.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import tempfile
import unicodedata
from datetime import datetime
from pathlib import Path

from trainctl.config.load import to_yaml
from trainctl.config.schema import RunConfig
from trainctl.core import hub
from trainctl.core import rundir as layout
from trainctl.launch import backends, code_record, tokenizer_record
from trainctl.launch.command import plan_record
from trainctl.launch.errors import LaunchError
from trainctl.plan import RunPlan

MAX_SUFFIX = 10_000  # far more collisions than any real use; beyond it something is wrong
SWEEPS_FOLDER = "sweeps"  # RUNS_DIR/sweeps/NAME/sweep.json: the sweep records (launch/sweep.py)
RESERVED = (SWEEPS_FOLDER,)  # names of the runs folder's own entries: never a run's name
WORKDIR_KEY = "workdir"  # plan.json: the directory the run was launched from (relative paths are taken from it)
NAME_MAX = 255 - len("-9999") - len(".tmp")  # bytes of one path component, leaving room for a suffix


def default_name(cfg: RunConfig, now: datetime | None = None) -> str:
    """`<recipe or model name>-<YYYYmmdd-HHMMSS>`."""
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    return f"{cfg.recipe or cfg.model.name}-{stamp}"


def check_name(name: str) -> None:
    """A run name must be one plain path component (it becomes a directory under runs_dir)."""
    # Whitespace too: the name lands in #SBATCH lines and script comments, where a newline would start a command.
    plain = not any(c in name for c in "/\\\0") and not any(c.isspace() or not c.isprintable() for c in name)
    if not name or not plain or name.startswith("."):
        raise LaunchError(f"run name {name!r} is not a plain directory name; use letters, digits, '-', '_' (no '/', no "
                          "spaces, not starting with '.')")
    if name in RESERVED:
        raise LaunchError(f"run name {name!r} is reserved: runs_dir/{name} holds the sweep records; choose another")
    if len(name.encode()) > NAME_MAX:
        raise LaunchError(f"run name {name[:40]!r}... is {len(name.encode())} bytes; "
                          f"use at most {NAME_MAX} (one directory name)")


def check_path(what: str, path: Path) -> None:
    """A path that goes into a script must not hold control characters (a newline would start a new line there)."""
    bad = sorted({repr(c) for c in str(path) if unicodedata.category(c).startswith("C")})
    if bad:
        raise LaunchError(f"{what} {str(path)!r} contains control characters ({', '.join(bad)}); "
                          "use a path without them (rename the directory or launch from another one)")


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
    return backends.for_cluster(cfg.cluster).render(cfg, run_dir, workdir)


def write_contents(
    target: Path, cfg: RunConfig, plan: RunPlan, run_dir: Path, overrides: list[str], workdir: Path
) -> None:
    """Write every file of the run into `target`; paths inside them refer to the final `run_dir`."""
    (target / layout.CONFIG).write_text(to_yaml(cfg))
    # The launch command is launch's, computed here for the final run directory; readers find it in plan.json.
    record = {**plan_record(plan, cfg, run_dir), WORKDIR_KEY: str(workdir), **hub_pins(cfg)}
    (target / layout.PLAN).write_text(json.dumps(record, indent=2) + "\n")
    write_script(target, cfg, run_dir, workdir)
    (target / layout.OVERRIDES).write_text("".join(f"{o}\n" for o in overrides))
    code = code_record.record()
    (target / layout.CODE).write_text(json.dumps(code.to_dict(), indent=2) + "\n")
    if code.diff:
        (target / layout.CODE_DIFF).write_text(code.diff)
    (target / layout.LOGS).mkdir()
    tokenizer_record.write(target, cfg)


def hub_pins(cfg: RunConfig) -> dict:
    """{"hub": {key: {name, revision}}} for the Hub models the run starts from (their cached snapshot's commit)."""
    folders = {"model.path": cfg.model.path, "checkpoint.init_from": cfg.checkpoint.init_from}
    pins = {key: pin for key, folder in folders.items() if folder and (pin := hub.pin(folder))}
    return {"hub": pins} if pins else {}


def write_script(target: Path, cfg: RunConfig, run_dir: Path, workdir: Path) -> None:
    """(Re)write target/launch.sh for a run that lives at `run_dir`."""
    script = target / layout.SCRIPT
    tmp = script.with_name(f".{layout.SCRIPT}.{os.getpid()}.tmp")
    tmp.write_text(launch_script(cfg, run_dir, workdir))
    tmp.chmod(0o755)
    os.replace(tmp, script)


def script_workdir(run_dir: Path) -> Path | None:
    """Where the run was launched from (its workers start there), or None when no record says.

    Read from plan.json's record; a run written before that record existed has it only in its launch script,
    where render_script wrote it as the line `cd <quoted path>`: that exact shape is matched, never a substring.
    """
    recorded = layout.as_str(layout.read_json(run_dir / layout.PLAN).get(WORKDIR_KEY))
    if recorded:
        return Path(recorded)
    try:
        lines = (run_dir / layout.SCRIPT).read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    for line in lines:
        if not line.startswith("cd "):
            continue
        try:
            words = shlex.split(line[3:])
        except ValueError:
            continue
        if len(words) == 1 and line == f"cd {shlex.quote(words[0])}":
            return Path(words[0])
    return None


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
    workdir = Path(workdir or Path.cwd())
    runs_dir = Path(runs_dir).resolve()
    check_path("the working directory", workdir)
    check_path("runs_dir", runs_dir / base)
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LaunchError(f"runs_dir={runs_dir}: cannot create it ({exc.strerror or exc}); "
                          "set runs_dir to a writable directory") from None
    try:
        run_dir = reserve(runs_dir, base)
    except OSError as exc:
        raise LaunchError(f"runs_dir={runs_dir}: cannot create a run directory in it ({exc.strerror or exc}); "
                          "set runs_dir to a writable directory with free space") from None
    tmp = None
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{run_dir.name[:100]}.", suffix=".tmp", dir=runs_dir))
        os.chmod(tmp, run_dir.stat().st_mode & 0o7777)  # mkdtemp's 0700 would hide the run from others
        write_contents(tmp, cfg, plan, run_dir, list(overrides or []), workdir)
        # rename(2) atomically replaces an empty directory, and only we know the reserved one.
        os.rename(tmp, run_dir)
    except BaseException as exc:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        run_dir.rmdir()
        if isinstance(exc, OSError):
            raise LaunchError(f"runs_dir={runs_dir}: writing run {run_dir.name} failed ({exc.strerror or exc}); "
                              "nothing was kept; free some space or set runs_dir to a writable directory") from None
        raise
    return run_dir
