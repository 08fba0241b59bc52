"""What the fuzz tests share: a per-example deadline (a hang fails the example), the errors a user may see, and
hypothesis settings bounded for CI's 2 cores."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, settings

from tests import helpers
from trainctl.core.errors import UserError
from trainctl.plan import PlanError

# The errors that reach the user as one line and exit code 2 (cli.main prints exactly these).
USER_ERRORS = (UserError, PlanError)

# Bounded: a fixed number of examples, no per-example timing deadline (CI shares 2 cores; `hang` is judged by
# `deadline` below instead), no database (every run explores afresh from the seed hypothesis derives).
BOUNDED = settings(max_examples=60, deadline=None, database=None, derandomize=False,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                          HealthCheck.data_too_large])


class Hang(Exception):
    """An example ran past its deadline."""


def deadline(seconds: float) -> contextlib.AbstractContextManager[None]:
    """Fail the example (raise Hang) when the block runs longer than `seconds` (SIGALRM; main thread only)."""
    return helpers.deadline(seconds, Hang)


def overlays_left() -> set[str]:
    """The temporary config overlays (`trainctl-conf-*`) in the temp folder now."""
    return {p.name for p in Path(tempfile.gettempdir()).glob("trainctl-conf-*")}
