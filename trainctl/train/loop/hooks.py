"""A seam on the worker's run(): callables the loop calls at fixed points, each None (no call, no cost) by default.

    on_setup(job)                 once, when setup has built the whole Job (job.py) and before the first step:
                                  a hook may keep what it needs or replace the job's parts with wrapped ones
                                  (e.g. job.contexts with another offload_context)
    on_loss(step, loss) -> loss   every micro-batch's training loss (step 0-based, plain and pipeline path alike),
                                  after normalization and before it is reported and fed to backward
    on_step_end(job, result)      after a step is logged, evaluated and maybe saved (result: step.StepResult);
                                  job.stop.request() there stops after the next step, exactly as a signal would
    before_commit(step)           on every rank, once every rank has written and reported its files of
                                  checkpoint `step`, before rank 0 commits it

Production runs set none. Tests inject faults through them (tests/faults): `TEST_HOOKS_ENV` names a
"module:function" that returns a Hooks, and only a process that has the variable imports anything for it.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

TEST_HOOKS_ENV = "TRAINCTL_TEST_HOOKS"


@dataclass(frozen=True)
class Hooks:
    on_setup: Callable[[Any], None] | None = None
    on_loss: Callable[[int, Any], Any] | None = None
    on_step_end: Callable[[Any, Any], None] | None = None
    before_commit: Callable[[int], None] | None = None


def hooks_from_env(env: dict = os.environ) -> Hooks:
    """The hooks a test asked for through TEST_HOOKS_ENV ("module:function" returning Hooks); none otherwise."""
    spec = env.get(TEST_HOOKS_ENV)
    if not spec:
        return Hooks()
    module, _, name = spec.partition(":")
    hooks = getattr(importlib.import_module(module), name)()
    if not isinstance(hooks, Hooks):
        raise TypeError(f"{TEST_HOOKS_ENV}={spec!r} returned {type(hooks).__name__}, not Hooks")
    return hooks
