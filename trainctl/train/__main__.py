"""Worker entry point: `python -m trainctl.train RUN_DIR` (under torchrun, or alone as a world of one).

Reads only the run directory. Every rank logs to RUN_DIR/logs/rank{R}.log; an error is
logged there (with its traceback) and ends the process with a nonzero exit code.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from pathlib import Path

from trainctl.config.schema import load_run_config

log = logging.getLogger("trainctl.train")

EXIT_CONFIG = 2  # the run directory asks for something we cannot do
EXIT_FAILURE = 1


def setup_logging(run_dir: Path, rank: int) -> None:
    """Every rank to logs/rank{R}.log; warnings and errors also to stderr (torchrun prefixes the rank)."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    to_file = logging.FileHandler(logs / f"rank{rank}.log")
    to_file.setFormatter(fmt)
    to_stderr = logging.StreamHandler(sys.stderr)
    to_stderr.setLevel(logging.WARNING)
    to_stderr.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    root.addHandler(to_file)
    root.addHandler(to_stderr)
    logging.captureWarnings(True)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m trainctl.train RUN_DIR", file=sys.stderr)
        return EXIT_CONFIG
    run_dir = Path(argv[0]).resolve()
    if not (run_dir / "config.yaml").is_file():
        print(f"{run_dir}: not a run directory (no config.yaml); create one with `trainctl launch`", file=sys.stderr)
        return EXIT_CONFIG
    setup_logging(run_dir, int(os.environ.get("RANK", 0)))
    # Which machine each rank ran on: the first thing to know when one node misbehaves.
    log.info("rank %s of %s on host %s, pid %d", os.environ.get("RANK", 0), os.environ.get("WORLD_SIZE", 1), socket.gethostname(), os.getpid())
    # Imported after logging is set up: torch import warnings land in the rank's log.
    from trainctl.train.checkpoint import CheckpointError
    from trainctl.train.data import DataError
    from trainctl.train.errors import WorkerConfigError
    from trainctl.train.guards import NonFiniteError
    from trainctl.train.trainer import run

    try:
        run(load_run_config(run_dir), run_dir)
    except (WorkerConfigError, DataError) as err:
        log.error("%s", err)
        return EXIT_CONFIG
    except (NonFiniteError, CheckpointError) as err:
        # Stopped on purpose with a message that says why and what to do: no traceback.
        log.error("%s", err)
        return EXIT_FAILURE
    except BaseException:
        log.exception("training failed")
        return EXIT_FAILURE
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
