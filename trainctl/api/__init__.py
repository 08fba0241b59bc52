"""trainctl's Python face: functions that take values and return values, print nothing, and raise
`trainctl.core.errors.UserError` (one line per problem) for what a user can fix. The CLI parses and renders them.

    from trainctl import api
    h = api.launch(["recipe=tiny_cpu", "train.steps=5"], wait=False)
    while not api.status(h.name).done: time.sleep(1)
    api.runs()
    api.evaluate("my-run", data="tok").perplexity

Every function checks its arguments against its annotations first (api/arguments.py): a wrong type is
a UserError line naming the argument, never a TypeError from inside.

Torch-free like the rest of the launcher side: a launch's workers, export, generate and eval run as children.
"""

from trainctl.api.configs import (
    cwd_problem,
    env_runs_dir,
    find_run,
    groups,
    recipes,
    resolved,
    runs_dir_of,
    search,
    shadow_notes,
)
from trainctl.api.handle import LaunchHandle
from trainctl.api.launching import (
    Prepared,
    compare,
    launch,
    launch_problems,
    plan,
    plan_record,
    prepare_launch,
    prepare_resume,
    resume,
    start,
)
from trainctl.api.sweeping import PreparedSweep, SweepResult, prepare_sweep, start_sweep, sweep
from trainctl.api.tools import evaluate, export, generate, prepare_data
from trainctl.api.tuning import tune
from trainctl.api.watching import Cancelled, RunInfo, SweepRanking, cancel, logs, plot, runs, status, sweep_runs
from trainctl.core.tool_options import (
    EXPORT_DTYPES,
    Completion,
    EvalOptions,
    EvalResult,
    ExportOptions,
    ExportReport,
    Generated,
    GenerateOptions,
    ToolFailed,
)

__all__ = [
    "Cancelled", "Completion", "EXPORT_DTYPES", "EvalOptions", "EvalResult", "ExportOptions", "ExportReport",
    "Generated", "GenerateOptions", "LaunchHandle", "Prepared", "PreparedSweep", "RunInfo", "SweepRanking",
    "ToolFailed",
    "SweepResult", "cancel", "compare", "cwd_problem", "env_runs_dir", "evaluate", "export", "find_run", "generate",
    "groups", "launch", "launch_problems", "logs", "plan", "plan_record", "plot", "prepare_data", "prepare_launch",
    "prepare_resume", "prepare_sweep", "recipes", "resolved", "resume", "runs", "runs_dir_of", "search",
    "shadow_notes", "start", "start_sweep", "status", "sweep", "sweep_runs", "tune",
]
