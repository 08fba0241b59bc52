"""Does a rank fit its device? Capacity, the framework's allowance, headroom and a verdict.

The memory plan (memory.py) predicts what the caching allocator hands out at the step's peak
(torch.cuda.max_memory_allocated). A device holds more than that, stated here as the framework
allowance, with these numbers and reasons:
- CUDA context, cuBLAS/cuDNN workspaces and kernels: 0.75 GiB per process (an H100 process
  under CUDA 12 with lazy module loading shows ~0.5-0.6 GiB in nvidia-smi before the first
  tensor; the workspaces add the rest).
- NCCL: 0.25 GiB per process-group dimension of size > 1 (each communicator's channel buffers,
  NCCL_BUFFSIZE 4 MiB x channels x peers, plus its internal allocations).
- Fragmentation: 10% of the peak (the caching allocator reserves more than it hands out when
  block sizes vary step to step; expandable_segments lowers it).
On a CPU the allowance is 0.5 GiB per worker process (the interpreter, torch's libraries, the
data loader), and the capacity is this machine's memory shared by the workers of a local launch
(unknown for a CPU job on Slurm nodes: no verdict).

Verdict: `fits` with at least 10% of the capacity left, `tight` with less (one bad sequence
length or allocator mood from an out-of-memory error), `does not fit` below zero.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from trainctl.config.schema import ClusterConfig
from trainctl.core.dims import ParallelDims
from trainctl.core.gpus import GPUS

GIB = 2**30
CUDA_CONTEXT_BYTES = int(0.75 * GIB)
NCCL_BYTES_PER_DIM = int(0.25 * GIB)
FRAGMENTATION = 0.10
CPU_PROCESS_BYTES = int(0.5 * GIB)
TIGHT_HEADROOM = 0.10  # of capacity


@dataclass(frozen=True)
class Fit:
    peak_bytes: int  # allocator peak (the plan's prediction)
    framework_bytes: int
    need_bytes: int  # peak + framework
    capacity_bytes: int | None
    headroom_bytes: int | None
    verdict: str  # fits | tight | does not fit | unknown

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def host_memory_bytes() -> int | None:
    """Physical memory of this machine; None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def capacity_bytes(cluster: ClusterConfig) -> int | None:
    """Memory one rank may use: its GPU's, or this machine's share per worker for a local CPU run."""
    if cluster.device == "cuda":
        spec = GPUS.get(cluster.gpu)
        return None if spec is None else int(spec.memory_gib * GIB)
    if cluster.launcher != "local":
        return None
    host = host_memory_bytes()
    return None if host is None else host // cluster.procs_per_node


def framework_bytes(peak: int, device: str, dims: ParallelDims) -> int:
    """The allowance on top of the allocator peak (module doc)."""
    if device != "cuda":
        return CPU_PROCESS_BYTES
    groups = sum(1 for size in dims.as_dict().values() if size > 1)
    return CUDA_CONTEXT_BYTES + NCCL_BYTES_PER_DIM * groups + int(FRAGMENTATION * peak)


def verdict(headroom: int | None, capacity: int | None) -> str:
    if headroom is None or capacity is None:
        return "unknown"
    if headroom < 0:
        return "does not fit"
    return "tight" if headroom < TIGHT_HEADROOM * capacity else "fits"


def fit(peak: int, device: str, dims: ParallelDims, capacity: int | None) -> Fit:
    framework = framework_bytes(peak, device, dims)
    need = peak + framework
    headroom = None if capacity is None else capacity - need
    return Fit(peak, framework, need, capacity, headroom, verdict(headroom, capacity))


def fits(f: Fit) -> bool:
    """Whether a launch may go ahead without --force (unknown capacity is not refused)."""
    return f.verdict != "does not fit"
