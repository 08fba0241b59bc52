"""Process group, device, seeding, CPU threads and the DeviceMesh of one worker.

Under torchrun the usual env vars (RANK, LOCAL_RANK, WORLD_SIZE, ...) describe the
world. Run directly (`python -m trainctl.train RUN_DIR`, RANK unset) the worker is a
world of one with an in-process store, so every code path below (mesh, collectives,
DDP/FSDP) is the same whether one rank or many.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainctl.config.schema import ClusterConfig
from trainctl.core.dims import MESH_DIMS, ParallelDims
from trainctl.train.errors import WorkerConfigError


@dataclass(frozen=True)
class World:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def pick_device(cluster: ClusterConfig, local_rank: int) -> torch.device:
    """cuda:LOCAL_RANK or cpu, as `cluster.device` asks; fails clearly if CUDA is missing."""
    if cluster.device == "cuda":
        if not torch.cuda.is_available():
            raise WorkerConfigError("cluster.device=cuda: no CUDA device is visible to this worker; use "
                                    "cluster.device=cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(cluster: ClusterConfig, cpu_collectives: bool = False) -> World:
    """Join the process group (nccl on CUDA, gloo on CPU) and pick this rank's device.

    cpu_collectives: on CUDA, also gloo for CPU tensors (FSDP2 CPU offload reduces the
    gradient norm and clips over host-memory gradients).
    """
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank, local_world = _env_int("LOCAL_RANK", 0), _env_int("LOCAL_WORLD_SIZE", 1)
    device = pick_device(cluster, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and cpu_collectives:
        backend = "cuda:nccl,cpu:gloo"
    global _own_group
    if dist.is_initialized():
        # A program that runs several workers' runs in one process formed the group once; each run joins it.
        if dist.get_world_size() != world_size:
            raise WorkerConfigError(f"the process group already formed has {dist.get_world_size()} ranks, the "
                                    f"environment says WORLD_SIZE={world_size}")
    elif "RANK" in os.environ:
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
        _own_group = True
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        _own_group = True
    return World(rank, local_rank, world_size, local_world, device)


_own_group = False  # whether init_distributed formed the default group (then close_distributed ends it)


def close_distributed() -> None:
    """End the process group this worker formed; one it joined stays for its owner (a group cannot be formed
    twice over torchrun's store: the second rendezvous would read the first one's keys)."""
    global _own_group
    if _own_group and dist.is_initialized():
        dist.destroy_process_group()
    _own_group = False


def set_cpu_threads(cluster: ClusterConfig, local_world_size: int) -> int:
    """torch intra-op threads: `cluster.cpu_threads`; else OMP_NUM_THREADS where it is a positive number (the
    launch script sets it to the node's cores shared among its ranks, and keeps a value the user exported on a
    local run); else the cores this process may run on, shared among the node's ranks. More threads than cores
    is not a little slower but many times slower: OpenMP's threads wait for each other at every kernel's end."""
    threads = cluster.cpu_threads or omp_threads() or max(1, usable_cores() // local_world_size)
    torch.set_num_threads(threads)
    return threads


def oversubscribed(threads: int, local_world_size: int) -> str | None:
    """A warning where this node's ranks run more torch threads than it has cores for them, else None."""
    cores = usable_cores()
    if threads * local_world_size <= cores:
        return None
    return (f"warning: {local_world_size} rank(s) x {threads} torch threads on {cores} cores: each rank runs many "
            f"times slower than on {max(1, cores // local_world_size)}; set cluster.cpu_threads or OMP_NUM_THREADS")


def usable_cores() -> int:
    """The cores this process may run on (its affinity: a Slurm job's cgroup, taskset), not the machine's count."""
    return len(os.sched_getaffinity(0))


def omp_threads() -> int:
    """OMP_NUM_THREADS as a number of threads; 0 where it is unset or not a positive number (OpenMP's own
    `4,2` nesting form counts its first level)."""
    first = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) > 0 else 0


def enable_tf32(device: torch.device) -> None:
    """fp32 matmuls on tensor cores (TF32): the peak FLOPs table assumes it."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def seed_everything(seed: int) -> None:
    """Same seed on every rank: identical init; data order comes from the data module's own seed."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_mesh(dims: ParallelDims, device: torch.device) -> DeviceMesh:
    """A DeviceMesh over every rank with all five named dims (size-1 dims included)."""
    if dims.world_size != dist.get_world_size():
        raise WorkerConfigError(
            f"sharding degrees {dims.as_dict()} multiply to {dims.world_size} but this job has "
            f"{dist.get_world_size()} ranks; relaunch from the run plan or fix cluster.nodes x cluster.procs_per_node"
        )
    if dims.ep > 1:
        from trainctl.train.parallel.expert import build_ep_mesh

        return build_ep_mesh(dims, device.type)  # dp_shard split into [efsdp, ep] (cp is refused with ep)
    shape = tuple(getattr(dims, name) for name in MESH_DIMS)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=MESH_DIMS)
    if dims.cp > 1:
        from trainctl.train.parallel.context_parallel import flatten_dp_cp

        flatten_dp_cp(mesh)
    return mesh


def dp_coordinates(mesh: DeviceMesh) -> tuple[int, int]:
    """(dp_rank, dp_size): this rank's place among the ranks that read different data."""
    replicate, shard = mesh["dp_replicate"], mesh["dp_shard"]
    dp_rank = replicate.get_local_rank() * shard.size() + shard.get_local_rank()
    return dp_rank, replicate.size() * shard.size()
