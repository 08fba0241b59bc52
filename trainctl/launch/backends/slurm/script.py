"""Slurm: the sbatch script of a run (submission: `submit.py`; job state and scancel: `jobs.py`; the rest: `__init__`).

One task per node runs torchrun, which starts `procs_per_node` workers; the
first node of the allocation hosts the c10d rendezvous. CPUs: `cluster.cpus_per_task`,
else cpu_threads x procs, else the whole node when exclusive, else one per worker.

Quoting: `#SBATCH` lines are read by sbatch, not by a shell, so they cannot be quoted;
their values are single tokens (validation refuses whitespace, and we check again here).
Every other value from the config reaches the shell through `shlex.quote`, except
`cluster.setup`, the one place where the user writes shell on purpose.

Preemption: Slurm sends `cluster.preemption.signal` lead_s seconds before the time limit
to every job step (not `B:`, which reaches only the batch shell); torchrun forwards it to
its workers (`--signals-to-handle`). An attempt started after more than `max_requeues`
requeues stops at once. The workers checkpoint on the signal and rank 0 requeues the job
(trainctl/train/loop/stop.py); the next attempt resumes from that checkpoint.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from trainctl.config.schema import RunConfig
from trainctl.config.slurm import PreemptionConfig, SlurmClusterConfig, cpus_per_task, exec_words, gpus_per_node
from trainctl.core import rundir
from trainctl.launch.backends.slurm import job_python
from trainctl.launch.backends.slurm.setup_check import setup_syntax_problems
from trainctl.launch.command import (
    Expand,
    handled_signals,
    lock_lines,
    omp_threads_export,
    output_args,
    shell_join,
    torchrun_env_exports,
    torchrun_module,
    worker_args,
)
from trainctl.launch.errors import LaunchError

ATTEMPTS_FILE = rundir.ATTEMPTS  # one line per attempt start and end, written by the job itself
REQUEUE_WAIT_S = 120  # longer than Slurm takes to end a requeued job's steps (KillWait is 30 s by default)
SETUP_BEGIN = "# ---- cluster.setup: user shell, kept verbatim (not quoted by trainctl) ----"
SETUP_END = "# ---- end of cluster.setup ----"


def batch_log(run_dir: Path) -> Path:
    """The batch script's own output, all attempts appended (`%j` is the job id)."""
    return run_dir / "logs" / "slurm-%j.out"


def attempt_log_name(job_id: str, attempt: int | str) -> str:
    """The workers' output of one attempt (srun --output): torchrun's messages and local rank 0 of each node."""
    return f"slurm-{job_id}.{attempt}.out"


def directive_value(what: str, value: str) -> str:
    # A directive ends at a newline and sbatch splits it at spaces; '%' would be read as a filename pattern.
    if re.search(r"[\s%]", value):
        raise LaunchError(f"{what} {value!r} cannot go into an #SBATCH line (whitespace or '%'); choose one without")
    return value


def directive_path_problems(cfg: RunConfig) -> list[str]:
    """The run directory goes into `#SBATCH --output=` (unquotable): its whole path, as the launch will make it
    absolute, must hold no whitespace or '%'; said before anything is written, with what works."""
    where = Path(cfg.runs_dir).expanduser().absolute()
    problems = []
    if re.search(r"[\s%]", str(where)):
        shown = f"runs_dir={cfg.runs_dir!r}" + (f" ({where})" if str(where) != cfg.runs_dir else "")
        problems.append(f"{shown}: Slurm reads the run directory from an #SBATCH line, which cannot hold whitespace "
                        "or '%'; set runs_dir to a path without (cluster=local takes any path)")
    if "%" in cfg.name:
        problems.append(f"name={cfg.name!r}: Slurm reads the run directory from an #SBATCH line, where '%' is a "
                        "filename pattern; pick a name without '%'")
    return problems


def job_name(cluster: SlurmClusterConfig, run_dir: Path) -> str:
    return cluster.job_name or run_dir.name


def resource_directives(cluster: SlurmClusterConfig) -> list[str]:
    lines = [f"--nodes={cluster.nodes}", "--ntasks-per-node=1"]
    gpus = gpus_per_node(cluster)
    if gpus:
        lines.append(f"--gpus-per-node={gpus}")
    cpus = cpus_per_task(cluster)
    if cpus:
        lines.append(f"--cpus-per-task={cpus}")
    if cluster.exclusive:
        lines.append("--exclusive")
    if cluster.mem:
        lines.append(f"--mem={cluster.mem}")
    lines.append(f"--time={cluster.time_limit}")
    return lines


def preemption_directives(p: PreemptionConfig) -> list[str]:
    # No `B:` prefix: the signal must reach torchrun in every job step, not the idle batch shell.
    lines = [f"--signal={p.signal.removeprefix('SIG')}@{p.lead_s}"] if p.lead_s > 0 else []
    lines.append("--requeue" if p.requeue else "--no-requeue")
    return lines


def sbatch_directives(cluster: SlurmClusterConfig, name: str, run_dir: Path) -> list[str]:
    """The #SBATCH lines: resources, scheduling keys that are set, logs, preemption, then the user's extras."""
    lines = [f"--job-name={directive_value('job name', name)}", *resource_directives(cluster)]
    for key in ("partition", "account", "qos", "constraint"):
        value = getattr(cluster, key)
        if value:
            lines.append(f"--{key}={directive_value(f'cluster.{key}', value)}")
    lines += [f"--output={directive_value('run directory', str(run_dir))}/logs/slurm-%j.out", "--open-mode=append"]
    lines += preemption_directives(cluster.preemption)
    for extra in cluster.extra_directives:
        if "\n" in extra or "\r" in extra:
            raise LaunchError(f"cluster.extra_directives entry {extra!r} spans several lines; one directive per entry")
        lines.append(extra)
    return [f"#SBATCH {line}" for line in lines]


def requeue_guard(p: PreemptionConfig) -> list[str]:
    """Stop an attempt that comes after more requeues than allowed (Slurm has no per-job cap)."""
    if not p.requeue:
        return []
    return [
        f'if [ "$ATTEMPT" -gt {p.max_requeues} ]; then',
        '  echo "trainctl: job $JOB was requeued $ATTEMPT times, '
        f'more than cluster.preemption.max_requeues={p.max_requeues}; not starting again" >&2',
        "  exit 1",
        "fi",
    ]


def environment_lines(cluster: SlurmClusterConfig, run_dir: Path) -> list[str]:
    """Our exports, then the user's (which may override ours), every value quoted."""
    # torchrun gives its workers TORCH_ELASTIC_SHUTDOWN_TIMEOUT after forwarding a signal before it kills them:
    # with an early preemption signal, its lead time (one export, not a default and then its override).
    shutdown = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(cluster.preemption.lead_s)} if cluster.preemption.lead_s > 0 \
        else {}
    lines = [
        omp_threads_export(cluster, "$SLURM_CPUS_ON_NODE", keep_user_value=False),
        "export PYTHONUNBUFFERED=1",
        *torchrun_env_exports(shutdown),
        *job_python.environment_lines(cluster, run_dir),
    ]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in cluster.env.items()]
    return lines


def setup_block(setup: list[str]) -> list[str]:
    if not setup:
        return []
    # Module and conda scripts often read unset variables; `set -u` would kill the job there.
    return [SETUP_BEGIN, "set +u", *setup, "set -u", SETUP_END]


def record_function() -> list[str]:
    """A shell function appending one JSON line per attempt start and end to RUN_DIR/slurm-attempts.jsonl.

    Slurm forgets finished jobs after MinJobAge and sacct needs accounting, so the run keeps its own record.
    Every value printed is a number or a Slurm node list: nothing needs JSON escaping.
    """
    fmt = '{"event": "%s", "job_id": "%s", "attempt": %s, "nodes": "%s", "exit_code": %s, "time": "%s"}\\n'
    return [
        "record() {",
        f'  printf \'{fmt}\' "$1" "$JOB" "$ATTEMPT" "$SLURM_JOB_NODELIST" "${{2:-null}}" "$(date -Iseconds)" '
        f'>> "$RUN_DIR/{ATTEMPTS_FILE}"',
        "}",
    ]


def container_options(cluster: SlurmClusterConfig, run_dir: Path) -> list[str]:
    """pyxis's srun options for `cluster.container.image` and its mounts (the default ones first); none without an
    image."""
    c = cluster.container
    if not c.image:
        return []
    mounts = job_python.all_mounts(cluster, run_dir)
    return [f"--container-image={c.image}", *([f"--container-mounts={','.join(mounts)}"] if mounts else [])]


def python_words(cluster: SlurmClusterConfig) -> list[str]:
    """How a Slurm job's step runs Python: the container prefix (if any), then the job's interpreter."""
    return [*exec_words(cluster), job_python.chosen_python(cluster)]


def slurm_argv(cluster: SlurmClusterConfig, run_dir: Path, srun_options: tuple[str, ...] = ()) -> list[str]:
    """srun starting one torchrun per node (the sbatch script sets MASTER_ADDR), in the job's container.

    Our srun options come last, so `cluster.srun_args` cannot move
    the logs. `Expand` arguments are expanded by the shell.
    """
    return [
        "srun",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        # Recent Slurm no longer passes the job's CPUs on to srun; without this torchrun and all its workers
        # share one core.
        Expand("--cpus-per-task=${SLURM_CPUS_ON_NODE}"),
        *container_options(cluster, run_dir),
        *cluster.srun_args,
        *srun_options,
        *python_words(cluster),
        "-m",
        torchrun_module(cluster),
        Expand("--nnodes=${SLURM_NNODES}"),
        f"--nproc-per-node={cluster.procs_per_node}",
        "--rdzv-backend=c10d",
        Expand(f"--rdzv-endpoint=${{MASTER_ADDR}}:{cluster.rdzv_port}"),
        Expand("--rdzv-id=${SLURM_JOB_ID}"),
        f"--max-restarts={cluster.max_restarts}",
        f"--signals-to-handle={handled_signals(cluster)}",
        *output_args(run_dir),
        *worker_args(run_dir),
    ]


def helper_python(cluster: SlurmClusterConfig, run_dir: Path) -> str:
    """The batch shell's Python for trainctl's bookkeeping (lock holder, completed run), already shell-quoted.

    It runs where the workers' Python does: under `container.exec`, or in a one-task step in the pyxis image.
    """
    step = (["srun", "--nodes=1", "--ntasks=1", "--kill-on-bad-exit=1", *container_options(cluster, run_dir)]
            if cluster.container.image else [])
    return shell_join([*step, *python_words(cluster)])


def requeue_fallback(p: PreemptionConfig) -> list[str]:
    """The batch shell requeues a job its workers stopped on the preemption signal, when rank 0 could not.

    Rank 0 runs `scontrol requeue` after the stop checkpoint; inside a container without Slurm's client it
    cannot. The stop must be this attempt's (stopped.json newer than the attempt's start record) and the run
    unfinished. When rank 0 did requeue, Slurm is already ending this job and refuses a second one: harmless.
    """
    if not p.requeue:
        return []
    stopped, attempts = f'"$RUN_DIR/{rundir.STOPPED}"', f'"$RUN_DIR/{ATTEMPTS_FILE}"'
    return [
        f'if [ -f {stopped} ] && [ {stopped} -nt {attempts} ] && [ ! -f "$RUN_DIR/{rundir.RESULT}" ] \\',
        f"   && grep -q '\"signal\": \"{p.signal}\"' {stopped}; then",
        '  scontrol requeue "$SLURM_JOB_ID" 2>/dev/null || echo "trainctl: job $JOB not requeued by the batch shell '
        '(already requeued by rank 0, or Slurm refused)" >&2',
        "fi",
    ]


def hang_requeue(cluster: SlurmClusterConfig, run_dir: Path) -> list[str]:
    """A job whose workers hung past torchrun's restarts goes back to the queue, the node that hung named
    (core/hangs.py answers which node, and whether it hung first in repeated attempts).

    A node that hung first repeatedly is excluded. Slurm refuses to change a running job's excluded nodes ("Job is
    no longer pending execution"), and this shell ends with the attempt: so the job is requeued held, and a small
    job submitted just before (exclusion_job) waits for it to be pending, excludes the node and releases it. Where
    that submission fails, the line gives the command to run by hand.
    """
    if not cluster.preemption.requeue:
        return []
    ask = f"{helper_python(cluster, run_dir)} -m trainctl.core.hangs"
    return [
        f'if [ "$STATUS" -ne 0 ] && [ ! -f "$RUN_DIR/{rundir.RESULT}" ] \\',
        f'   && HUNG=$({ask} hung "$RUN_DIR" "$SLURM_JOB_ID" "$ATTEMPT"); then',
        '  echo "trainctl: job $JOB attempt $ATTEMPT hung on node(s) $HUNG (no progress for train.hang_timeout_s; '
        f'stacks under $RUN_DIR/{rundir.HANGS}); requeueing" >&2',
        "  REQUEUE=requeue",
        f'  if EXCLUDE=$({ask} repeated "$RUN_DIR" "$SLURM_JOB_ID"); then',
        "    REQUEUE=requeuehold",
        '    EXCLUDE_CMD="scontrol update JobId=$SLURM_JOB_ID ExcNodeList=$EXCLUDE && scontrol release $SLURM_JOB_ID"',
        f"    if FIXER=$({exclusion_job(cluster)}); then",
        '      echo "trainctl: node(s) $EXCLUDE hung first in repeated attempts of job $JOB: requeued held; job $FIXER '
        'excludes them and releases it ($EXCLUDE_CMD)" >&2',
        "    else",
        '      echo "trainctl: node(s) $EXCLUDE hung first in repeated attempts of job $JOB: requeued held (Slurm '
        'excludes nodes only from a pending job, and the job that would do it was refused); exclude them and '
        'release it with: $EXCLUDE_CMD" >&2',
        "    fi",
        "  fi",
        "  # The end is recorded first: the requeue may kill this shell at once.",
        '  record end "$STATUS"',
        '  if scontrol "$REQUEUE" "$SLURM_JOB_ID"; then',
        *wait_for_requeue_kill(),
        "  fi",
        '  echo "trainctl: job $JOB not requeued after the hang (Slurm refused)" >&2',
        '  exit "$STATUS"',
        "fi",
    ]


EXCLUSION_WAIT_S = 600  # for the held job to be pending: Slurm first ends its steps (KillWait, 30 s by default)


def exclusion_job(cluster: SlurmClusterConfig) -> str:
    """`sbatch --parsable ...` of a one-task job that waits for this job to be pending (held), then runs
    $EXCLUDE_CMD: the shell fills in the job id and nodes at submission. Same partition, account and qos."""
    options = ['"--job-name=trainctl-exclude-$SLURM_JOB_ID"', "--nodes=1", "--ntasks=1", "--time=15",
               '"--output=$RUN_DIR/logs/slurm-exclude-%j.out"']
    options += [f"--{key}={shlex.quote(getattr(cluster, key))}" for key in ("partition", "account", "qos")
                if getattr(cluster, key)]
    # Inside the double quotes of --wrap: \\$ and \\" reach the wrapped script as $ and "; $SLURM_JOB_ID and
    # $EXCLUDE_CMD are this job's, filled in now.
    pending = (f'for i in \\$(seq {EXCLUSION_WAIT_S}); do '
               '[ \\"\\$(squeue -h -j $SLURM_JOB_ID -o %T)\\" = PENDING ] && break; sleep 1; done')
    return f'sbatch --parsable {" ".join(options)} --wrap "{pending}; $EXCLUDE_CMD"'


def wait_for_requeue_kill() -> list[str]:
    """After `scontrol requeue` (or requeuehold), Slurm ends this attempt and queues the job again. A batch shell
    that exits first with the failed status can win that race, and Slurm (22.05) then ends the job FAILED instead
    of queueing it: wait for the kill, bounded (TRAINCTL_REQUEUE_WAIT_S, default REQUEUE_WAIT_S)."""
    return [
        # A builtin wait: a `sleep` child would inherit the run's lock and outlive this shell holding it, and the
        # requeued attempt would find the run locked. `read` on a pipe nobody writes returns at the timeout.
        f'    read -r -t "${{TRAINCTL_REQUEUE_WAIT_S:-{REQUEUE_WAIT_S}}}" _ <> <(:) || true',
        '    exit "$STATUS"',
    ]


def launch_lines(cluster: SlurmClusterConfig, run_dir: Path) -> list[str]:
    """Head node, the srun line with the attempt's log, and the attempt's records."""
    srun_options = (Expand("--output=${ATTEMPT_LOG}"), "--open-mode=append")
    srun = shell_join(slurm_argv(cluster, run_dir, srun_options=srun_options))
    return [
        *record_function(),
        "# The first node of the allocation hosts the rendezvous. No `| head -n 1`: under pipefail,",
        "# scontrol dying of SIGPIPE after head exits would fail the job.",
        'NODES=$(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        "MASTER_ADDR=${NODES%%$'\\n'*}",
        "export MASTER_ADDR",
        f'ATTEMPT_LOG="$RUN_DIR/logs/{attempt_log_name("$JOB", "$ATTEMPT")}"',
        'echo "trainctl: job $JOB attempt $ATTEMPT on $SLURM_JOB_NODELIST, '
        f'rendezvous $MASTER_ADDR:{cluster.rdzv_port}; workers\' output: $ATTEMPT_LOG"',
        "record start",
        "STATUS=0",
        f"{srun} || STATUS=$?",
        "# The run's own record decides: a stop signal reaching torchrun after the last step fails it, not the run.",
        f'[ "$STATUS" -eq 0 ] || [ ! -f "$RUN_DIR/{rundir.RESULT}" ] || STATUS=0',
        *requeue_fallback(cluster.preemption),
        *hang_requeue(cluster, run_dir),
        'record end "$STATUS"',
        'exit "$STATUS"',
    ]


def render_sbatch(cfg: RunConfig, run_dir: Path, workdir: Path | None = None) -> str:
    """The complete sbatch script for a run whose directory is `run_dir` (absolute paths recommended).

    Raises LaunchError when `cluster.setup` breaks the script's shell syntax (see `setup_problems`).
    """
    script = _script(cfg, run_dir, workdir or Path.cwd())
    problems = setup_syntax_problems(cfg.cluster.setup, script)
    if problems:
        raise LaunchError(problems[0])
    return script


def setup_problems(cfg: RunConfig) -> list[str]:
    """`cluster.setup` lines that do not pass `bash -n`, alone and inside the script; one line, or none.

    Checked before a run directory is written; the run directory's path does not change the syntax.
    """
    if not cfg.cluster.setup:
        return []
    try:
        script = _script(cfg, Path("/run-dir-placeholder"), Path("/workdir-placeholder"))
    except LaunchError:
        return []  # a bad directive value: validation reports that one
    return setup_syntax_problems(cfg.cluster.setup, script)


def _script(cfg: RunConfig, run_dir: Path, workdir: Path) -> str:
    c = cfg.cluster
    return "\n".join(
        [
            "#!/bin/bash",
            *sbatch_directives(c, job_name(c, run_dir), run_dir),
            "",
            f"# Generated by trainctl. Submit again with: sbatch RUN_DIR/{rundir.SCRIPT}",
            *job_python.header_lines(c, run_dir),
            "set -euo pipefail",
            f"RUN_DIR={shlex.quote(str(run_dir))}",
            "ATTEMPT=${SLURM_RESTART_COUNT:-0}  # 0, then 1, 2, ... after each requeue",
            "# The job as squeue and sacct name it: a sweep's array task is ARRAYID_TASK.",
            "JOB=${SLURM_ARRAY_JOB_ID:+${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}}",
            "JOB=${JOB:-$SLURM_JOB_ID}",
            *requeue_guard(c.preemption),
            f"cd {shlex.quote(str(workdir))}",
            *environment_lines(c, run_dir),
            *setup_block(list(c.setup)),
            *job_python.import_check_lines(c, helper_python(c, run_dir)),
            "# One trainer per run directory: the batch shell holds the run's lock for the job's lifetime (on the",
            "# shared filesystem); a requeued attempt takes it again. Its Python is the job's (cluster.python).",
            *lock_lines(helper_python(c, run_dir), accept_inherited=False),
            *launch_lines(c, run_dir),
            "",
        ]
    )
