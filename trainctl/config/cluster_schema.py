"""The cluster group's typed config: the keys every backend has (the local backend's own config), and the registry
of each backend's subclass by `cluster.launcher`. schema.py re-exports all of it (RunConfig holds a ClusterConfig).

Like schema.py, imported on both sides of the wall: free of torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from trainctl.config.fields import at_least, choice, within

DEVICES = ("cpu", "cuda")
RANK_STARTS = ("auto", "fork", "exec")


def _gpus() -> tuple[str, ...]:
    """cluster.gpu: empty (unknown device) or a key of the GPU table."""
    from trainctl.core.gpus import GPUS

    return ("", *GPUS)


@dataclass(frozen=True)
class ClusterConfig:
    """Where the workers run and how many there are: the keys every backend has, and the local backend's config.

    Each backend (`cluster=local`, `cluster=slurm`, ...) has its own typed config, a subclass that adds its keys
    and answers, as class attributes and properties, what plan/ and config/ must know about it (never by its
    name). `register_cluster` makes one known; composing builds the class its `launcher` names.
    """

    NAME: ClassVar[str] = "local"
    # Whether the workers run on the machine that launches them (its devices and memory are theirs).
    on_this_machine: ClassVar[bool] = True
    # Whether a run may span several nodes (`cluster.nodes` > 1).
    multi_node: ClassVar[bool] = False

    launcher: str = choice("local", lambda: launchers())  # the backend: local | slurm | any registered one
    nodes: int = at_least(1, 1)
    procs_per_node: int = at_least(1, 1)  # torchrun --nproc_per_node: GPUs (or CPU workers) per node
    device: str = choice("cpu", DEVICES)  # cpu | cuda
    # Accelerator model for peak FLOPs and memory (h100_sxm, h100_pcie, h200, a100_80gb, a100_40gb, ...); "" unknown.
    gpu: str = choice("", _gpus)
    # MFU the plan's step time assumes; 0: the plan's default (0.4, see plan/throughput.py)
    assumed_mfu: float = within(0.0, 0, 1)
    max_restarts: int = at_least(0, 0)  # torchrun --max-restarts (whole-group restarts after a worker failure)
    rdzv_port: int = within(29500, 1, 65535)
    # torch threads per CPU worker; 0: OMP_NUM_THREADS if set (the launch sets cores / procs_per_node and a local
    # run keeps a value you exported), else cores / procs_per_node
    cpu_threads: int = at_least(0, 0, "0: OMP_NUM_THREADS, which the launch sets to cores / workers")
    # How torchrun starts each rank: fork, from an agent that imported torch and the worker once (train/agent.py);
    # exec, a new interpreter per rank (plain torchrun); auto: fork on cpu, exec on cuda
    rank_start: str = choice("auto", RANK_STARTS)

    def __post_init__(self) -> None:
        # A config of one backend naming another would be read by the wrong backend.
        if self.launcher != self.NAME:
            raise ValueError(f"{type(self).__name__} is cluster={self.NAME}, not launcher={self.launcher!r}; "
                             "use that backend's config class (schema.cluster_configs())")

    @property
    def forks_ranks(self) -> bool:
        """Whether the ranks are forked from an agent that imported the worker (`rank_start`, resolved)."""
        return self.rank_start == "fork" or (self.rank_start == "auto" and self.device == "cpu")

    @property
    def stop_signal(self) -> str:
        """The signal that asks the workers to checkpoint and stop (besides SIGTERM and SIGINT)."""
        return DEFAULT_STOP_SIGNAL

    @property
    def requeues(self) -> bool:
        """Whether a worker stopped by `stop_signal` puts its job back in the queue."""
        return False

    @property
    def job_env(self) -> dict[str, str]:
        """Environment the backend adds to the workers' (on top of the launching shell's)."""
        return {}

    def problems(self) -> list[str]:
        """This backend's own checks of its keys, one line each."""
        if self.nodes > 1 and not self.multi_node:
            return [f"cluster.nodes={self.nodes}: a {self.launcher} launch runs on this machine only; "
                    "use cluster=slurm for several nodes"]
        return []


DEFAULT_STOP_SIGNAL = "SIGUSR2"  # SIGUSR1 is NCCL's; SIGTERM is what schedulers send to end a job now

# The typed cluster config of each backend, by `cluster.launcher` (built-ins load on first use).
_CLUSTERS: dict[str, type[ClusterConfig]] = {ClusterConfig.NAME: ClusterConfig}
BUILTIN_CLUSTER_MODULES = ("trainctl.config.slurm",)


def register_cluster(cls: type[ClusterConfig]) -> type[ClusterConfig]:
    """Make `cluster.launcher=cls.NAME` compose into `cls` (a class decorator); a third backend calls this."""
    if not (isinstance(cls, type) and issubclass(cls, ClusterConfig)):
        raise TypeError(f"{cls!r} is not a ClusterConfig subclass")
    _CLUSTERS[cls.NAME] = cls
    return cls


def unregister_cluster(name: str) -> None:
    if name != ClusterConfig.NAME:
        _CLUSTERS.pop(name, None)


def cluster_configs() -> dict[str, type[ClusterConfig]]:
    """Every registered backend's config class, by name; the built-in backends first."""
    import importlib

    for module in BUILTIN_CLUSTER_MODULES:
        importlib.import_module(module)
    return dict(_CLUSTERS)


def launchers() -> tuple[str, ...]:
    return tuple(cluster_configs())
