"""Temporary shim: the run plan moved to trainctl.plan.runplan (import it from trainctl.plan)."""

from trainctl.plan.runplan import *  # noqa: F401,F403
from trainctl.plan.runplan import ASSUMED_MFU, PlanError, RunPlan, build, refusal  # noqa: F401
