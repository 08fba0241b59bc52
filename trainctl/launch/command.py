"""The torchrun command line that starts the workers, locally or inside an sbatch script.

Both launchers run the same `torch.distributed.run ... -m trainctl.train RUN_DIR`, as
`<python> -m torch.distributed.run`, or as `<python> -m trainctl.train.agent` with the same
arguments where the ranks start by fork (`cluster.rank_start`; train/agent.py): locally with the
interpreter that planned the run (the workers share its environment); in a Slurm job with
`cluster.python`, found where the job runs (after `cluster.setup`, inside the container), never
the launching venv's path. torch is imported only in that child process, never here.

Output: every rank's stdout/stderr is captured under RUN_DIR/logs/torchrun/
(`--redirects=3`), and only local rank 0 is also shown on the console
(`--tee=3 --local-ranks-filter=0`); the workers write RUN_DIR/logs/rank{R}.log themselves.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from trainctl.config.schema import ClusterConfig, RunConfig
from trainctl.core import rundir

WORKER_MODULE = "trainctl.train"
TORCHRUN_LOG_SUBDIR = "logs/torchrun"
TORCHRUN_DEFAULT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # torchrun's own default for --signals-to-handle


class Expand(str):
    """An argument the shell must expand (`${SLURM_NNODES}`); only our own templates are marked so.

    Deciding by content instead would let a path containing `${` and `$(...)` run commands.
    """


RunDir = Path | Expand  # a literal path, or a shell expression such as "${RUN_DIR}" (the script finds itself)
RUN_DIR_VAR = Expand("${RUN_DIR}")


def under(run_dir: RunDir, rel: str) -> str:
    """`run_dir/rel`, kept expandable when run_dir is a shell expression."""
    return Expand(f"{run_dir}/{rel}") if isinstance(run_dir, Expand) else str(Path(run_dir) / rel)


def _flag(flag: str, value: str) -> str:
    return Expand(f"{flag}={value}") if isinstance(value, Expand) else f"{flag}={value}"


def lock_lines(python: str, accept_inherited: bool) -> list[str]:
    """Script lines that take the run's trainer lock (RUN_DIR must be set) or exit 2 naming its holder.

    The lock is a flock on RUN_DIR/trainer.lock held by the script's shell and whatever it execs (torchrun);
    it dies with them. `accept_inherited`: a launcher that already holds it passes the descriptor in
    TRAINCTL_LOCK_FD (the local backend, launch/backends/local). `python` is already shell-quoted.
    """
    take = f'exec {{TRAINCTL_LOCK_FD}}>>"$RUN_DIR/{rundir.LOCK}"'
    lines = ['case "${TRAINCTL_LOCK_FD:-}" in', f"  ''|*[!0-9]*) {take} ;;", "esac"] if accept_inherited else [take]
    return [
        *lines,
        f'flock -n "$TRAINCTL_LOCK_FD" || exec {python} -m trainctl.core.rundir refusal "$RUN_DIR"',
        # The holder on record is this shell, which execs torchrun: `trainctl cancel` signals torchrun itself,
        # so a launcher that died (kill -9) does not leave a run nobody can cancel.
        f'{python} -m trainctl.core.rundir hold "$RUN_DIR" "$$"',
        # A finished run is not trained again (its result would be rewritten): `trainctl resume` extends it.
        f'{python} -m trainctl.core.rundir completed "$RUN_DIR" && exit 0',
        "unset TRAINCTL_LOCK_FD",
    ]


TORCHRUN_MODULE = "torch.distributed.run"
AGENT_MODULE = "trainctl.train.agent"  # the same torchrun, its ranks forked after one import (cluster.rank_start)


def torchrun_module(cluster: ClusterConfig) -> str:
    """torch.distributed.run, or trainctl's agent running it where the ranks start by fork (cluster.rank_start)."""
    return AGENT_MODULE if cluster.forks_ranks else TORCHRUN_MODULE


def torchrun_prefix(cluster: ClusterConfig, python: str | None = None) -> list[str]:
    return [python or sys.executable, "-m", torchrun_module(cluster)]


def output_args(run_dir: RunDir) -> list[str]:
    """Capture all ranks to files, show local rank 0 on the console."""
    log_dir = _flag("--log-dir", under(run_dir, TORCHRUN_LOG_SUBDIR))
    return [log_dir, "--redirects=3", "--tee=3", "--local-ranks-filter=0"]


def worker_args(run_dir: RunDir) -> list[str]:
    return ["-m", WORKER_MODULE, run_dir if isinstance(run_dir, Expand) else str(run_dir)]


def handled_signals(cluster: ClusterConfig) -> str:
    """torchrun's --signals-to-handle: its defaults plus the preemption signal, all forwarded to the workers."""
    names = list(TORCHRUN_DEFAULT_SIGNALS)
    if cluster.preemption.signal not in names:
        names.append(cluster.preemption.signal)
    return ",".join(names)


def launch_argv(cluster: ClusterConfig, run_dir: Path) -> list[str]:
    """The command the configured backend starts the workers with."""
    from trainctl.launch import backends

    return backends.for_cluster(cluster).argv(cluster, run_dir)


# Stands in for the run directory before it exists (its name may get a collision suffix).
RUN_DIR_PLACEHOLDER = "<run_dir>"


def default_run_dir(cfg: RunConfig) -> Path:
    """Where the run would go when its name is already fixed; a placeholder name otherwise."""
    return Path(cfg.runs_dir) / (cfg.name or RUN_DIR_PLACEHOLDER)


def command_record(cluster: ClusterConfig, run_dir: Path) -> dict:
    """The launch command as plan.json records it: the argv and the shell line."""
    argv = launch_argv(cluster, run_dir)
    return {"launch_argv": list(argv), "launch_command": shell_join(argv)}


def plan_record(plan, cfg: RunConfig, run_dir: Path | None = None) -> dict:
    """A RunPlan's data with the command that launches it on `run_dir` (the default run directory if None).

    What RUN_DIR/plan.json holds and what `trainctl plan` shows: the plan itself knows nothing of launching.
    """
    return {**plan.to_dict(), **command_record(cfg.cluster, run_dir or default_run_dir(cfg))}


def _quote_keeping_vars(arg: str) -> str:
    # Double quotes keep ${VAR} live for the shell while protecting spaces; escape what double quotes don't.
    escaped = arg.replace("\\", "\\\\").replace('"', '\\"').replace("`", "\\`")
    return f'"{escaped}"'


def shell_join(argv: list[str]) -> str:
    """One shell line; `Expand` arguments keep their variables expandable, all others are quoted literally."""
    return " ".join(_quote_keeping_vars(a) if isinstance(a, Expand) else shlex.quote(a) for a in argv)


# torchrun shares its rendezvous store with the workers and, in torch 2.11-2.13, reuses it unprefixed
# after a restart: restarted workers read the dead ones' addresses and hang in init_process_group
# (pytorch/pytorch#135712). A store of their own makes `cluster.max_restarts` actually restart.
# torchrun gives its workers this long to leave after forwarding a stop signal, then SIGKILLs them: a stop
# finishes the step and commits a checkpoint first, which can take minutes for a large model.
# (A second Ctrl-C does not wait: the launcher kills torchrun, and the workers die with it.)
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "900"}


def torchrun_env_exports(overrides: dict[str, str] | None = None) -> list[str]:
    """One export per variable: TORCHRUN_ENV's values, or the backend's own where it has one."""
    return [f"export {name}={value}" for name, value in {**TORCHRUN_ENV, **(overrides or {})}.items()]


def omp_threads_export(cluster: ClusterConfig, cores: str, keep_user_value: bool) -> str:
    """The launch script's OMP_NUM_THREADS line: cluster.cpu_threads, else `cores` / workers.

    torchrun would otherwise force one thread per worker. `cores` is a shell expression
    for the node's CPU count (`$(nproc)` locally, `$SLURM_CPUS_ON_NODE` in a job). A local
    run keeps a value the user exported; a Slurm job does not, since sbatch would carry
    over whatever the login shell happened to have.
    """
    if cluster.cpu_threads > 0:
        return f"export OMP_NUM_THREADS={cluster.cpu_threads}"
    n = cluster.procs_per_node
    share = f"$(( {cores} / {n} > 0 ? {cores} / {n} : 1 ))"
    if keep_user_value:
        return f"export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-{share}}}"
    return f"export OMP_NUM_THREADS={share}"
