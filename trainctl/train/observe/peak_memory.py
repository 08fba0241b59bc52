"""Peak memory of one training step on this rank, measured, next to the plan's prediction.

On CUDA the allocator knows: the peak is `torch.cuda.max_memory_allocated` over the step (its
counter reset at the step's start), the figure the plan predicts. What the allocator reserves
beyond it (fragmentation), the CUDA context and NCCL's buffers are not in it; the plan states
them separately as its framework allowance.

On CPU there is no allocator counter, so the step runs under torch's profiler with memory
profiling: every allocation and free of the CPU allocator (resizes of FSDP2's storages included)
is an event, and the largest running sum is the step's rise. The peak is then the model states
alive at the step's start (parameters, optimizer states, DDP's gradient buckets) plus that rise.
The process's peak resident set size (RSS: the interpreter, libraries, data) is logged beside it.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from trainctl.core import rundir
from trainctl.train.observe.memory_stats import model_state_bytes


def ddp_bucket_bytes(model: nn.Module) -> int:
    """Bytes of DDP's flat gradient buckets (0 for anything but DDP)."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return 0
    sizes = str(model._get_ddp_logging_data().get("bucket_sizes", ""))
    return sum(int(s) for s in sizes.split(",") if s.strip())


def _allocation_events(profiler) -> list[tuple[int, int]]:
    """(time ns, bytes: + allocated, - freed) of every CPU allocator event the profiler recorded."""
    from torch._C._profiler import _EventType

    events, stack = [], list(profiler.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.typed[0] == _EventType.Allocation and str(node.typed[1].device) == "cpu":
            events.append((node.start_time_ns, node.typed[1].alloc_size))
        stack.extend(node.children)
    return sorted(events)


def largest_rise(events: list[tuple[int, int]]) -> int:
    """The largest running sum of allocation events: how far memory rose above where it started."""
    current = peak = 0
    for _, size in events:
        current += size
        peak = max(peak, current)
    return peak


@contextlib.contextmanager
def stderr_silenced() -> Iterator[None]:
    """File descriptor 2 goes to /dev/null for the block: C++ code writing to it (not sys.stderr) is muted."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class PeakMeter:
    """Measures one step's peak: `start()` before the forward, `stop()` after the optimizer step."""

    def __init__(self, device: torch.device, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.device = device
        self._profiler = None
        self._baseline = 0
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            return
        states = model_state_bytes(model, optimizer)
        states_bytes = states["params_bytes"] + states["grads_bytes"] + states["optimizer_bytes"]
        self._baseline = states_bytes + ddp_bucket_bytes(model)
        from torch.profiler import ProfilerActivity, profile

        self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with stderr_silenced():  # Kineto prints "USDT: ... profiler_start" (and _stop) on the process's stderr
            self._profiler.__enter__()

    def stop(self) -> dict:
        """{peak_bytes, peak_source, and on CPU: rss_peak_bytes} of the step."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            return {"peak_bytes": peak, "peak_source": "cuda_max_memory_allocated"}
        with stderr_silenced():
            self._profiler.__exit__(None, None, None)
        rise = largest_rise(_allocation_events(self._profiler))
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        return {"peak_bytes": self._baseline + rise, "peak_source": "cpu_tracked_tensors", "rss_peak_bytes": rss}


def memory_step(begin: int, steps: int) -> int:
    """The step (0-based) whose peak is measured: the third, a steady one, or the last of a shorter run.

    The first step creates the optimizer states; in the second DDP rebuilds its buckets in the
    order gradients arrived (a free the CPU profiler cannot see, of memory allocated before it).
    """
    return min(begin + 2, steps - 1)


def read_prediction(run_dir: Path) -> dict | None:
    """The plan's per-rank memory prediction from RUN_DIR/plan.json (plain JSON); None without one."""
    try:
        plan = json.loads((run_dir / rundir.PLAN).read_text())
    except (OSError, ValueError):
        return None
    memory = plan.get("memory") or {}
    if "peak_bytes" not in memory:
        return None  # a plan from before the per-rank memory model
    keys = ("peak_bytes", "params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "peak_phase")
    stages = [{k: s[k] for k in keys if k in s} for s in memory.get("per_pp_rank", [])]
    return {**{k: memory[k] for k in keys if k in memory}, "per_pp_rank": stages, "pp": len(stages) or 1}


def with_prediction(record: dict, prediction: dict | None) -> dict:
    """The memory record with the plan's prediction beside it: `predicted`, and per rank its pp stage's peak.

    Ranks are laid out pp-major (trainctl/train/parallel/distributed.MESH_DIMS), so rank r is on pp rank
    r // (world / pp).
    """
    if prediction is None:
        return record
    per_rank, stages = record.get("per_rank", []), prediction["per_pp_rank"]
    if stages and per_rank and len(per_rank) % len(stages) == 0:
        span = len(per_rank) // len(stages)
        per_rank = [{**r, "predicted_peak_bytes": stages[i // span]["peak_bytes"]} for i, r in enumerate(per_rank)]
    return {**record, "per_rank": per_rank, "predicted": prediction}
