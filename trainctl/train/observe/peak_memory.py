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
The optimizer step's own rise is reported apart (step_temp_bytes, the plan's step temporaries), less the buffers an
operator allocates and frees within itself (step_workspace_bytes: a kernel library's, which the plan does not model)
and those of other threads (gloo's).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
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


STEP_MARK = "trainctl.optimizer_step"  # the profiler's range around the optimizer step (PeakMeter.optimizer_step)


@dataclass(frozen=True)
class Allocation:
    time_ns: int
    size: int  # + allocated, - freed
    ptr: int
    op: int  # the outermost operator (aten::, c10d:: ...) it happened in, by identity; 0: in Python code
    thread: int


def _allocation_events(profiler) -> tuple[list[Allocation], tuple[int, int, int] | None]:
    """Every CPU allocator event the profiler recorded, in time order, and the optimizer step's (start ns, end ns,
    thread)."""
    from torch._C._profiler import _EventType

    events, window, stack = [], None, [(node, 0) for node in profiler.profiler.kineto_results.experimental_event_tree()]
    while stack:
        node, op = stack.pop()
        if node.typed[0] == _EventType.Allocation and str(node.typed[1].device) == "cpu":
            events.append(Allocation(node.start_time_ns, node.typed[1].alloc_size, node.typed[1].ptr, op,
                                     node.start_tid))
        elif node.name == STEP_MARK:
            window = (node.start_time_ns, node.end_time_ns, node.start_tid)
        elif not op and "::" in node.name:
            op = id(node)
        stack.extend((child, op) for child in node.children)
    return sorted(events, key=lambda e: e.time_ns), window


def profiled_rise(profiler) -> int:
    """The largest rise of every CPU allocation a finished profiler recorded."""
    return largest_rise(e.size for e in _allocation_events(profiler)[0])


def own_thread(events: list[Allocation], thread: int) -> list[Allocation]:
    """The events of buffers `thread` allocated, wherever freed: gloo's worker thread allocates its flat buffers at
    times that vary run to run (like NCCL's on CUDA, a communication library's, not the step's), and it frees a
    collective's input when its work ends, which is the step's tensor all the same."""
    foreign: set[int] = set()
    kept = []
    for e in events:
        if e.size > 0 and e.thread != thread:
            foreign.add(e.ptr)
        elif e.size < 0 and e.ptr in foreign:
            foreign.discard(e.ptr)
        else:
            kept.append(e)
    return kept


def without_workspace(events: list[Allocation]) -> list[Allocation]:
    """The events less the buffers one operator allocates and frees within itself: a kernel library's workspace
    (oneDNN's packing buffers for a bf16 matmul on CPU, sized by its blocking, not by the tensors), which the plan
    does not model; what is left are the tensors the step's code holds."""
    open_in_op: dict[tuple[int, int], int] = {}
    internal: set[int] = set()
    for i, e in enumerate(events):
        if not e.op:
            continue
        if e.size > 0:
            open_in_op[(e.op, e.ptr)] = i
        elif (e.op, e.ptr) in open_in_op:
            internal |= {open_in_op.pop((e.op, e.ptr)), i}
    return [e for i, e in enumerate(events) if i not in internal]


def largest_rise(sizes: Iterable[int]) -> int:
    """The largest running sum of allocation events' sizes: how far memory rose above where it started."""
    current = peak = 0
    for size in sizes:
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

    def optimizer_step(self) -> contextlib.AbstractContextManager:
        """Around the optimizer step: on CPU a profiler range, whose allocations stop() reports apart."""
        if self._profiler is None:
            return contextlib.nullcontext()
        return torch.autograd.profiler.record_function(STEP_MARK)

    def stop(self) -> dict:
        """{peak_bytes, peak_source, and on CPU: rss_peak_bytes} of the step."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            return {"peak_bytes": peak, "peak_source": "cuda_max_memory_allocated"}
        with stderr_silenced():
            self._profiler.__exit__(None, None, None)
        events, window = _allocation_events(self._profiler)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        peak = self._baseline + largest_rise(e.size for e in events)
        out = {"peak_bytes": peak, "peak_source": "cpu_tracked_tensors", "rss_peak_bytes": rss}
        if window is not None:  # the optimizer step alone: what the plan's step_temp predicts, and the workspace
            inside = own_thread([e for e in events if window[0] <= e.time_ns <= window[1]], window[2])
            tensors = largest_rise(e.size for e in without_workspace(inside))
            out |= {"step_temp_bytes": tensors, "step_workspace_bytes": largest_rise(e.size for e in inside) - tensors}
        return out


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
    keys = ("peak_bytes", "params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "step_temp_bytes",
            "peak_phase")
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
