"""The run plan: what a resolved config will do, computed before anything starts (no torch)."""

from trainctl.plan.runplan import PlanError, RunPlan, build, refusal

__all__ = ["PlanError", "RunPlan", "build", "refusal"]
