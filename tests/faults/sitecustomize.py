"""Runs at the start of every interpreter whose PYTHONPATH holds this folder (tests put it there: fault_env).

It only reads one environment variable; with TRAINCTL_FAULTS set it installs worker_faults' import hook.
A sitecustomize this one shadows (a distribution's, later on sys.path) still runs.
"""

import importlib.util
import os
import sys
from pathlib import Path


def _run_shadowed() -> None:
    here = Path(__file__).resolve().parent
    for entry in sys.path:
        try:
            candidate = Path(entry or ".").resolve() / "sitecustomize.py"
        except OSError:
            continue
        if candidate.is_file() and candidate.parent != here:
            spec = importlib.util.spec_from_file_location("_shadowed_sitecustomize", candidate)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


_run_shadowed()
if os.environ.get("TRAINCTL_FAULTS"):
    import worker_faults

    worker_faults.install_from_env()
