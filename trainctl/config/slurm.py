"""The Slurm keys of `cluster`: derived resource counts and their validation.

Values that end up in `#SBATCH` lines cannot be shell-quoted (sbatch reads directives
itself), so anything that would split or end a directive is refused here, before a run
directory is written. Everything else (env values, paths) is quoted by the renderer.
"""

from __future__ import annotations

import re

from trainctl.config import schema

# Slurm's --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S, or no limit.
TIME_RE = re.compile(
    r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+(:\d{1,2}){0,2}|UNLIMITED|INFINITE|unlimited|infinite)$"
)
MEM_RE = re.compile(r"^\d+[KMGT]?$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MAX_SIGNAL_LEAD_S = 65535  # Slurm's limit for --signal=SIG@TIME


def gpus_per_node(c: schema.ClusterConfig) -> int:
    """GPUs to ask for on each node: the configured count, else one per worker on cuda and none on cpu."""
    if c.gpus_per_node >= 0:
        return c.gpus_per_node
    return c.procs_per_node if c.device == "cuda" else 0


def cpus_per_task(c: schema.ClusterConfig) -> int:
    """CPUs of the one task per node; 0 means "the whole node" (exclusive jobs get all of its CPUs)."""
    if c.cpus_per_task > 0:
        return c.cpus_per_task
    if c.cpu_threads > 0:
        return c.cpu_threads * c.procs_per_node
    # Slurm's default is one CPU per task, which torchrun's workers would all share.
    return 0 if c.exclusive else c.procs_per_node


def _one_token(key: str, value: str) -> list[str]:
    """A directive value: no whitespace, which would split the #SBATCH line or end it (a newline)."""
    if re.search(r"\s", value):
        return [f"cluster.{key}={value!r}: an #SBATCH value cannot contain spaces or newlines"]
    return []


def check_directive_values(c: schema.ClusterConfig) -> list[str]:
    problems = []
    for key in ("partition", "account", "qos", "constraint", "job_name", "mem", "time_limit"):
        problems += _one_token(key, getattr(c, key))
    if c.mem and not MEM_RE.match(c.mem):
        problems.append(f"cluster.mem={c.mem!r}: use a size per node such as 64G, 512000M, or 0 for all of it")
    if not TIME_RE.match(c.time_limit):
        problems.append(f"cluster.time_limit={c.time_limit!r}: use Slurm's format, e.g. 90, 04:00:00, 2-00:00:00")
    for i, line in enumerate(c.extra_directives):
        if "\n" in line or "\r" in line:
            problems.append(f"cluster.extra_directives[{i}]={line!r}: one directive per entry; "
                            "a newline would end the #SBATCH line")
        elif not line.startswith("-"):
            problems.append(f"cluster.extra_directives[{i}]={line!r}: an sbatch option such as --reservation=NAME "
                            "(it is written as '#SBATCH <entry>')")
    return problems


def check_resources(c: schema.ClusterConfig) -> list[str]:
    problems = []
    if c.gpus_per_node < -1:
        problems.append(f"cluster.gpus_per_node={c.gpus_per_node}: use -1 (one per worker on cuda) or a count >= 0")
    elif c.device == "cpu" and c.gpus_per_node > 0:
        problems.append(f"cluster.gpus_per_node={c.gpus_per_node}: cluster.device=cpu runs no GPU workers; "
                        "use -1 or 0, or cluster.device=cuda")
    elif c.device == "cuda" and 0 <= c.gpus_per_node < c.procs_per_node:
        problems.append(
            f"cluster.gpus_per_node={c.gpus_per_node}: fewer GPUs than cluster.procs_per_node={c.procs_per_node} "
            "workers; each worker needs one GPU"
        )
    if c.cpus_per_task < 0:
        problems.append(f"cluster.cpus_per_task={c.cpus_per_task}: must be >= 0 (0 derives it)")
    return problems


def check_env(c: schema.ClusterConfig) -> list[str]:
    return [f"cluster.env.{name}: not a valid environment variable name; use letters, digits and '_'"
            for name in c.env if not ENV_NAME_RE.match(name)]


def check_preemption(p: schema.PreemptionConfig) -> list[str]:
    problems = []
    if p.signal not in schema.PREEMPTION_SIGNALS:
        problems.append(f"cluster.preemption.signal={p.signal!r}: not a valid choice; "
                        f"use one of: {', '.join(schema.PREEMPTION_SIGNALS)}")
    if not 0 <= p.lead_s <= MAX_SIGNAL_LEAD_S:
        problems.append(f"cluster.preemption.lead_s={p.lead_s}: must be in [0, {MAX_SIGNAL_LEAD_S}] seconds; "
                        "0 sends no early signal")
    if p.max_requeues < 0:
        problems.append(f"cluster.preemption.max_requeues={p.max_requeues}: must be >= 0")
    return problems


def check_slurm(c: schema.ClusterConfig) -> list[str]:
    """Every problem with the Slurm keys (defaults pass, so a local run is never bothered)."""
    return check_directive_values(c) + check_resources(c) + check_env(c) + check_preemption(c.preemption)
