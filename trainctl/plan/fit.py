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
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from trainctl.config.schema import ClusterConfig
from trainctl.core.dims import ParallelDims
from trainctl.core.gpus import GPUS, match_gpu

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
    if not cluster.on_this_machine:
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


# ---------------------------------------------------------------- the GPUs of this machine (a local launch's)


@dataclass(frozen=True)
class Machine:
    """What a local launch will find here: the NVIDIA GPUs its workers can see ("" where the model is unknown)."""

    gpus: tuple[str, ...]
    hidden_by: str = ""  # CUDA_VISIBLE_DEVICES=... when it hides every GPU


def this_machine(root: Path = Path("/"), environ: Mapping[str, str] | None = None) -> Machine:
    """The NVIDIA GPUs of this machine, found without torch or a driver call.

    The driver lists each GPU under /proc/driver/nvidia/gpus/<bus>/information (its `Model:`) and makes a
    device file /dev/nvidiaN per GPU (containers get both for the GPUs they were given);
    CUDA_VISIBLE_DEVICES narrows or hides them (empty or -1: none). `root` moves both folders, for tests.
    """
    env = os.environ if environ is None else environ
    names = [_model_name(info) for info in sorted((root / "proc/driver/nvidia/gpus").glob("*/information"))]
    try:
        devices = [p for p in (root / "dev").iterdir() if re.fullmatch(r"nvidia\d+", p.name)]
    except OSError:
        devices = []
    gpus = names + [""] * max(0, len(devices) - len(names))
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return Machine(tuple(gpus))
    wanted = [v for v in visible.split(",") if v.strip()]
    if not wanted or wanted[0].strip() == "-1":
        return Machine((), hidden_by=f"CUDA_VISIBLE_DEVICES={visible!r}" if gpus else "")
    return Machine(tuple(gpus[: len(wanted)]))


def _model_name(info: Path) -> str:
    try:
        text = info.read_text(errors="replace")[:4096]
    except OSError:
        return ""
    match = re.search(r"^Model:\s*(.+)$", text, re.MULTILINE)
    return match.group(1).strip() if match else ""


def device_label(device: str, gpu: str) -> str:
    """What one rank runs on, as the plan names it: the GPU kind, a GPU, or a CPU worker."""
    if device != "cuda":
        return "CPU worker"
    return gpu or "GPU"


def local_device_problems(cluster: ClusterConfig, machine: Machine) -> list[str]:
    """Why a local launch cannot run on this machine's devices (launch refuses these)."""
    if not cluster.on_this_machine:
        return []
    none = f"this machine has no NVIDIA GPU{_hidden(machine)}"
    if cluster.device == "cuda" and not machine.gpus:
        return [f"cluster.device=cuda: {none}; use cluster.device=cpu cluster.gpu= to train on the CPU, "
                "or launch where the GPU is (e.g. cluster=slurm)"]
    if cluster.device == "cuda" and cluster.procs_per_node > len(machine.gpus):
        count = len(machine.gpus)
        return [f"cluster.procs_per_node={cluster.procs_per_node}: one worker per GPU, and this machine shows "
                f"{count} GPU{'s' if count > 1 else ''}; use cluster.procs_per_node={count}"]
    if cluster.device != "cuda" and cluster.gpu and not machine.gpus:
        return [f"cluster.gpu={cluster.gpu}: {none}, and cluster.device={cluster.device} would train on the CPU; "
                "use cluster.gpu= for a CPU run, or launch where the GPU is (cluster.device=cuda, e.g. cluster=slurm)"]
    return []


def device_warning(cluster: ClusterConfig, machine: Machine) -> str | None:
    """What the plan says when a local launch's device is not what this machine has (or not what it runs on)."""
    if not cluster.on_this_machine:
        return None
    problems = local_device_problems(cluster, machine)
    if problems:
        return f"{problems[0].split('; ')[0]}: a launch refuses it"
    if cluster.device != "cuda" and cluster.gpu:
        return (f"cluster.gpu={cluster.gpu} is not used: cluster.device={cluster.device} trains on the CPU (the "
                "plan's memory is this machine's); set cluster.device=cuda to train on the GPU")
    spec = GPUS.get(cluster.gpu)
    found = {match_gpu(name) for name in machine.gpus if name}
    if cluster.device == "cuda" and spec is not None and found and all(GPUS.get(k) is not spec for k in found):
        names = ", ".join(sorted({name for name in machine.gpus if name}))
        keys = ", ".join(sorted(k or "unknown" for k in found))
        return (f"cluster.gpu={cluster.gpu}: this machine's GPU is {names} ({keys}); the plan's memory and step "
                f"time assume {cluster.gpu}: set cluster.gpu to what it has")
    return None


def _hidden(machine: Machine) -> str:
    return f" visible ({machine.hidden_by} hides them)" if machine.hidden_by else ""
