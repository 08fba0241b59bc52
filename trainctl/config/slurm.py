"""The Slurm backend's config: its typed keys (`cluster=slurm`), derived resource counts, and their validation.

Values that end up in `#SBATCH` lines cannot be shell-quoted (sbatch reads directives
itself), so anything that would split or end a directive is refused here, before a run
directory is written. Everything else (env values, paths) is quoted by the renderer.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import ClassVar

from trainctl.config import schema
from trainctl.config.schema import ClusterConfig, register_cluster

# Slurm's --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S, or no limit.
TIME_RE = re.compile(
    r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+(:\d{1,2}){0,2}|UNLIMITED|INFINITE|unlimited|infinite)$"
)
MEM_RE = re.compile(r"^\d+[KMGT]?$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# pyxis: SRC:DST[:FLAGS], several joined with commas on --container-mounts (so no comma inside one).
MOUNT_RE = re.compile(r"^[^:,\s]+:/[^:,\s]*(:[^:,\s]+)?$")
MAX_SIGNAL_LEAD_S = 65535  # Slurm's limit for --signal=SIG@TIME
PREEMPTION_SIGNALS = ("SIGUSR2", "SIGUSR1", "SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


@dataclass(frozen=True)
class PreemptionConfig:
    """Slurm: the early-warning signal before the time limit, and requeueing.

    SIGUSR2 by default: SIGTERM is what Slurm itself sends when it ends a job (scancel,
    preemption, the time limit), with only KillWait seconds to go, so it cannot also be the
    early warning; SIGUSR1 is used by NCCL. The signal is sent to every job step (not `B:`,
    which reaches only the batch shell), where torchrun forwards it to its workers.
    """

    signal: str = schema.DEFAULT_STOP_SIGNAL  # one of PREEMPTION_SIGNALS
    lead_s: int = 120  # seconds before the time limit; 0: no early signal (Slurm rounds to ~60 s)
    requeue: bool = True  # sbatch --requeue: the job may go back to the queue (preemption, node failure)
    max_requeues: int = 3  # an attempt after this many requeues stops instead of training


@dataclass(frozen=True)
class ContainerConfig:
    """Where the job's Python runs: a pyxis image (srun --container-image) or a command prefix; neither: the node."""

    image: str = ""  # pyxis/enroot image for srun --container-image, e.g. nvcr.io#nvidia/pytorch:25.01-py3
    mounts: list[str] = field(default_factory=list)  # pyxis --container-mounts entries, each SRC:DST[:FLAGS]
    exec: str = ""  # a prefix every Python of the job runs under, e.g. "apptainer exec --nv /images/train.sif"
    # With `image`: also mount the run's runs folder (same path) and the launcher's trainctl code (on PYTHONPATH).
    default_mounts: bool = True


@register_cluster
@dataclass(frozen=True)
class SlurmClusterConfig(ClusterConfig):
    """`cluster=slurm`: one torchrun per node through sbatch + srun, on the nodes Slurm allocates."""

    NAME: ClassVar[str] = "slurm"
    on_this_machine: ClassVar[bool] = False
    multi_node: ClassVar[bool] = True

    launcher: str = "slurm"
    partition: str = ""
    account: str = ""
    qos: str = ""
    time_limit: str = "01:00:00"  # sbatch --time: MM, HH:MM:SS, D-HH:MM:SS, ...
    gpus_per_node: int = -1  # -1: procs_per_node on cuda, 0 on cpu
    # CPUs of the one task per node; 0: cpu_threads x procs, else the node if exclusive, else procs.
    cpus_per_task: int = 0
    mem: str = ""  # sbatch --mem per node (64G, 0 = all of it); "": the partition's default
    constraint: str = ""  # sbatch --constraint (node features)
    exclusive: bool = False  # whole nodes
    job_name: str = ""  # "": the run directory's name
    array_parallelism: int = 0  # a sweep's job array runs at most this many points at once (--array=0-N%P); 0: all
    extra_directives: list[str] = field(default_factory=list)  # each becomes `#SBATCH <line>`, e.g. --reservation=x
    setup: list[str] = field(default_factory=list)  # shell lines run before srun (module load, ...), verbatim
    env: dict[str, str] = field(default_factory=dict)  # exported in the job, values quoted
    # The job's Python (torchrun and trainctl's own bookkeeping): a path, or a name found on PATH after `setup`;
    # "": the launching interpreter without a container, `python` inside one.
    python: str = ""
    container: ContainerConfig = field(default_factory=ContainerConfig)
    srun_args: list[str] = field(default_factory=list)  # extra srun options for the workers' step, e.g. --mpi=none
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)

    @property
    def stop_signal(self) -> str:
        return self.preemption.signal

    @property
    def requeues(self) -> bool:
        return self.preemption.requeue

    @property
    def job_env(self) -> dict[str, str]:
        return dict(self.env)

    def problems(self) -> list[str]:
        return check_slurm(self)


def gpus_per_node(c: SlurmClusterConfig) -> int:
    """GPUs to ask for on each node: the configured count, else one per worker on cuda and none on cpu."""
    if c.gpus_per_node >= 0:
        return c.gpus_per_node
    return c.procs_per_node if c.device == "cuda" else 0


def cpus_per_task(c: SlurmClusterConfig) -> int:
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


def check_directive_values(c: SlurmClusterConfig) -> list[str]:
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


def check_resources(c: SlurmClusterConfig) -> list[str]:
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


def check_env(c: SlurmClusterConfig) -> list[str]:
    return [f"cluster.env.{name}: not a valid environment variable name; use letters, digits and '_'"
            for name in c.env if not ENV_NAME_RE.match(name)]


def check_preemption(p: PreemptionConfig) -> list[str]:
    problems = []
    if p.signal not in PREEMPTION_SIGNALS:
        problems.append(f"cluster.preemption.signal={p.signal!r}: not a valid choice; "
                        f"use one of: {', '.join(PREEMPTION_SIGNALS)}")
    if not 0 <= p.lead_s <= MAX_SIGNAL_LEAD_S:
        problems.append(f"cluster.preemption.lead_s={p.lead_s}: must be in [0, {MAX_SIGNAL_LEAD_S}] seconds; "
                        "0 sends no early signal")
    if p.max_requeues < 0:
        problems.append(f"cluster.preemption.max_requeues={p.max_requeues}: must be >= 0")
    return problems


def check_slurm(c: SlurmClusterConfig) -> list[str]:
    """Every problem with the Slurm keys (defaults pass, so a local run is never bothered)."""
    return (check_directive_values(c) + check_resources(c) + check_env(c) + check_preemption(c.preemption)
            + check_container(c))


def check_container(c: SlurmClusterConfig) -> list[str]:
    """The job's Python, container and srun options: each one line, what would work included."""
    problems = []
    if c.python and (not c.python.strip() or re.search(r"\s", c.python)):
        problems.append(f"cluster.python={c.python!r}: one command or path without spaces, e.g. python3 or "
                        "/opt/venv/bin/python (a wrapper goes into cluster.container.exec)")
    k = c.container
    if k.image and k.exec:
        problems.append(f"cluster.container.image={k.image!r} and cluster.container.exec={k.exec!r}: choose one "
                        "(image: pyxis's srun --container-image; exec: a prefix such as apptainer exec --nv IMAGE)")
    if k.mounts and not k.image:
        problems.append("cluster.container.mounts: pyxis mounts need cluster.container.image; with "
                        "cluster.container.exec, bind paths in the prefix (e.g. apptainer exec --bind SRC:DST)")
    for i, mount in enumerate(k.mounts):
        if not MOUNT_RE.match(mount):
            problems.append(f"cluster.container.mounts[{i}]={mount!r}: use SRC:DST[:FLAGS] with an absolute DST, "
                            "no spaces or commas, e.g. /data:/data:ro")
    if k.image and re.search(r"[\s,]", k.image):
        problems.append(f"cluster.container.image={k.image!r}: one image name or path without spaces or commas")
    problems += _exec_problems(k.exec)
    for i, arg in enumerate(c.srun_args):
        if not arg.startswith("-") or "\n" in arg or "\r" in arg:
            problems.append(f"cluster.srun_args[{i}]={arg!r}: one srun option per entry, such as --mpi=none")
    return problems


def _exec_problems(prefix: str) -> list[str]:
    if not prefix:
        return []
    try:
        words = shlex.split(prefix)
    except ValueError as exc:
        return [f"cluster.container.exec={prefix!r}: {exc}; write the prefix as shell words, quotes balanced"]
    if not words:
        return [f"cluster.container.exec={prefix!r}: no command; use e.g. 'apptainer exec --nv /images/train.sif'"]
    return []


def exec_words(c: SlurmClusterConfig) -> list[str]:
    """The container prefix as argv words (each quoted again when rendered: no expansion, no injection)."""
    return shlex.split(c.container.exec) if c.container.exec else []
