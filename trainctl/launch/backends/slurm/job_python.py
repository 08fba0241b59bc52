"""The Slurm job's Python and what it must import.

- Which interpreter: `cluster.python` when set; else, without a container, the launching interpreter (the one
  that runs `trainctl launch`, whose venv holds trainctl and torch: the nodes' `python` on PATH is often the
  system's, without either); inside a container (`image` or `exec`), the image's `python`.
- What a pyxis image sees: with `container.default_mounts`, the run's runs folder at the same path (the workers
  read and write the run directory) and the launcher's trainctl package read-only under CODE_MOUNT, put first on
  PYTHONPATH, so the workers run the same trainctl as the launcher did; the image brings torch and the other
  dependencies. The sbatch header states every mount.
- Checks: here, before anything is submitted, what this machine can tell (the launching interpreter's torch; an
  explicit interpreter's import of trainctl when no container or setup stands between); in the job, one line
  before the lock and torchrun that the job's Python imports trainctl and torch, else a one-line refusal.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import trainctl
from trainctl.config.slurm import SlurmClusterConfig
from trainctl.launch.errors import LaunchError

CODE_MOUNT = "/opt/trainctl/code"  # inside the image: CODE_MOUNT/trainctl is the launcher's package
IMPORT_CHECK = "import trainctl, torch"
CHECK_TIMEOUT_S = 120  # an interpreter on a slow shared filesystem; a hung one is reported, not waited for


def in_container(cluster: SlurmClusterConfig) -> bool:
    return bool(cluster.container.image or cluster.container.exec)


def chosen_python(cluster: SlurmClusterConfig) -> str:
    """cluster.python, else `python` inside a container, else the launching interpreter."""
    if cluster.python:
        return cluster.python
    return "python" if in_container(cluster) else sys.executable


def _mount_path(path: Path, what: str) -> str:
    text = os.path.abspath(path)
    if any(c in text for c in ":,") or any(c.isspace() for c in text):
        raise LaunchError(f"{what} {text}: pyxis cannot mount a path holding ':', ',' or spaces; set "
                          "cluster.container.default_mounts=false and mount it yourself (cluster.container.mounts)")
    return text


def default_mounts(cluster: SlurmClusterConfig, run_dir: Path) -> list[tuple[str, str]]:
    """(pyxis mount entry, what it is) of the default mounts; none without an image or with default_mounts off.
    A destination the user mounts already is left to the user's entry."""
    if not cluster.container.image or not cluster.container.default_mounts:
        return []
    runs = _mount_path(Path(run_dir).parent, "the runs folder")
    code = _mount_path(Path(trainctl.__file__).resolve().parent, "trainctl's code")
    taken = {m.split(":")[1] for m in cluster.container.mounts}
    found = [(f"{runs}:{runs}", "the runs folder, at the same path"),
             (f"{code}:{CODE_MOUNT}/trainctl:ro", "the launcher's trainctl, on PYTHONPATH")]
    return [(entry, why) for entry, why in found if entry.split(":")[1] not in taken]


def all_mounts(cluster: SlurmClusterConfig, run_dir: Path) -> list[str]:
    return [entry for entry, _ in default_mounts(cluster, run_dir)] + list(cluster.container.mounts)


def header_lines(cluster: SlurmClusterConfig, run_dir: Path) -> list[str]:
    """Comment lines saying where the job's Python runs and what the image sees."""
    python = chosen_python(cluster)
    if cluster.container.exec:
        return [f"# The job's Python: {python} under the prefix cluster.container.exec (bind paths there)."]
    if not cluster.container.image:
        source = "cluster.python" if cluster.python else "the interpreter that launched the run"
        return [f"# The job's Python: {python} ({source})."]
    lines = [f"# The job's Python: {python} in the pyxis image {cluster.container.image}; mounts:"]
    lines += [f"#   {entry}  ({why})" for entry, why in default_mounts(cluster, run_dir)]
    lines += [f"#   {entry}  (cluster.container.mounts)" for entry in cluster.container.mounts]
    if len(lines) == 1:
        lines[0] = lines[0].removesuffix("; mounts:") + "; no mounts (the image must see the run directory)."
    return lines


def environment_lines(cluster: SlurmClusterConfig, run_dir: Path) -> list[str]:
    """The PYTHONPATH export that makes the mounted trainctl the one the image's Python imports."""
    if not any(f":{CODE_MOUNT}/" in entry for entry, _ in default_mounts(cluster, run_dir)):
        return []
    return [f'export PYTHONPATH={CODE_MOUNT}"${{PYTHONPATH:+:$PYTHONPATH}}"']


def import_check_lines(cluster: SlurmClusterConfig, helper_python: str) -> list[str]:
    """The job's first Python: it must import trainctl and torch, else the job stops with one line saying why."""
    where = (f" in the image {cluster.container.image}" if cluster.container.image
             else " under cluster.container.exec" if cluster.container.exec else " on the nodes")
    mounted = cluster.container.default_mounts
    fix = ("install torch and the dependencies of trainctl in the image (pip install trainctl)" + (
           "" if mounted else ", or set cluster.container.default_mounts=true") if cluster.container.image
           else "set cluster.python to an interpreter that has them (e.g. /shared/venv/bin/python) or activate its "
           "environment in cluster.setup")
    python = chosen_python(cluster)
    message = f"trainctl: the Python of the job ({python}){where} cannot import trainctl and torch; {fix}"
    return [f"if ! {helper_python} -c {shlex.quote(IMPORT_CHECK)}; then",
            f"  echo {shlex.quote(message)} >&2",
            "  exit 1",
            "fi"]


def local_problems(cluster: SlurmClusterConfig) -> list[str]:
    """What this machine can tell about the job's Python before submitting (one line each)."""
    if in_container(cluster):
        return []  # the image is the nodes' to open: the job checks it (import_check_lines)
    if not cluster.python:
        if importlib.util.find_spec("torch") is None:
            return [f"cluster.python: the launching interpreter ({sys.executable}) has no torch, and the job would "
                    "run it; install torch there, or set cluster.python to an interpreter that has trainctl and torch"]
        return []
    found = shutil.which(cluster.python)
    if cluster.setup or found is None:
        return []  # found on the nodes after cluster.setup: the job checks it
    try:
        done = subprocess.run([found, "-c", IMPORT_CHECK], capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [f"cluster.python={cluster.python}: could not be run here ({exc}); give an interpreter that has "
                "trainctl and torch"]
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["exit code " + str(done.returncode)])[-1]
        return [f"cluster.python={cluster.python}: cannot import trainctl and torch ({last}); give the environment's "
                f"interpreter (e.g. {sys.executable}) or install them there"]
    return []
