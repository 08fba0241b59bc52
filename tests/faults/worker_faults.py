"""Faults and probes the tests inject into the worker through its hooks seam (trainctl/train/loop/hooks.py).

A test asks for them through the environment of the processes it starts (`fault_env`): TRAINCTL_FAULTS holds
{name: argument} as JSON, and TRAINCTL_TEST_HOOKS names `hooks` below, which the worker (and only the worker)
imports and calls once. Nothing in a worker module is patched; in-process tests call `hooks_of` directly.

    nan_at_step: N        the training loss of step N (1-based, as logged) is multiplied by NaN before backward,
                          on every micro-batch, plain or pipeline: the gradients are NaN too
    inf_at_step: N        fp16: at step N (0-based; logged as N + 1) the gradient that backward sends from each
                          micro-batch's loss is multiplied by inf, forcing an overflow; the loss (forward) and so
                          the reported loss stay the true ones
    stop_after_step: N    every rank asks for a stop after step N, as a signal would (but no signal: exit code 0)
    die_before_commit: N  every rank SIGKILLs itself once every file of checkpoint N is written, before the
                          commit (first attempt under torchrun only)
    hang_after_step: N    rank 1 blocks forever (in `hang_forever`) once step N is logged, first attempt only
                          (torchrun's and Slurm's restart counts both 0): the other ranks block in the next
                          step's collective
    hang_in_setup: true   rank 1 blocks forever (in `hang_forever`) at the end of setup, before any step, first
                          attempt only: the other ranks block in the first collective
    hang_on_host: [H, N]  like hang_after_step, but on every attempt whose rank 1 runs on host H (a Slurm node)
    offload_probe: DIR    count the saved-tensor packs/unpacks of the activation-offload context the worker enters;
                          each rank writes DIR/offload-rank{RANK}.json at exit
    sample_probe: DIR     record the training samples each step reads: each rank appends a line
                          {"step", "dp_rank", "ids"} (ids: the global sample indices of its micro-batches, in order)
                          to DIR/samples-rank{RANK}.jsonl per step, every attempt on the same file
"""

from __future__ import annotations

import atexit
import json
import math
import os
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from trainctl.train.loop.hooks import TEST_HOOKS_ENV, Hooks

FAULTS_ENV = "TRAINCTL_FAULTS"
REPO = Path(__file__).resolve().parents[2]


def fault_env(**faults: object) -> dict[str, str]:
    """The environment variables that give a started worker these faults (merge into its environment).

    The repository root goes first on PYTHONPATH: the worker imports this module as tests.faults.worker_faults.
    """
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, TEST_HOOKS_ENV: f"{__name__}:hooks", FAULTS_ENV: json.dumps(faults)}


def hooks() -> Hooks:
    """What TRAINCTL_TEST_HOOKS names: the hooks of the faults in TRAINCTL_FAULTS (none when it is unset)."""
    return hooks_of(json.loads(os.environ.get(FAULTS_ENV) or "{}"))


def hooks_of(faults: dict) -> Hooks:
    """One Hooks for {fault name: argument}: each fault's hooks, called in turn where several share a point."""
    parts = [FAULTS[name](argument) for name, argument in faults.items()]
    return Hooks(
        on_setup=_each([p.on_setup for p in parts]),
        on_loss=_chain([p.on_loss for p in parts]),
        on_step_end=_each([p.on_step_end for p in parts]),
        before_commit=_each([p.before_commit for p in parts]),
    )


def _each(calls: list[Callable | None]) -> Callable | None:
    calls = [c for c in calls if c is not None]
    if not calls:
        return None

    def each(*args) -> None:
        for call in calls:
            call(*args)

    return each


def _chain(adjusts: list[Callable | None]) -> Callable | None:
    adjusts = [a for a in adjusts if a is not None]
    if not adjusts:
        return None

    def adjusted(step, loss):
        for adjust in adjusts:
            loss = adjust(step, loss)
        return loss

    return adjusted


# --- the faults: each returns the hooks it needs ------------------------------------------------------

def nan_at_step(step: int) -> Hooks:
    return Hooks(on_loss=lambda at, loss: loss * float("nan") if at == step - 1 else loss)


def inf_at_step(step: int) -> Hooks:
    return Hooks(on_loss=lambda at, loss: _InfGradient.apply(loss) if at == step else loss)


class _InfGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the incoming gradient by inf (an fp16 overflow, made to order)."""

    @staticmethod
    def forward(ctx, loss):
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * math.inf


def stop_after_step(step: int) -> Hooks:
    """Request the stop once step N-1 is done (or at setup, when the run starts there): step N's agreement
    carries it to every rank, which save step N and leave, as after a stop signal during step N."""

    def on_setup(job):
        if job.progress.step == step - 1:
            job.stop.request()

    def on_step_end(job, result):
        if result.step == step - 1:
            job.stop.request()

    return Hooks(on_setup=on_setup, on_step_end=on_step_end)


def die_before_commit(step: int) -> Hooks:
    def die(at: int) -> None:
        if at == step and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os.kill(os.getpid(), signal.SIGKILL)

    return Hooks(before_commit=die)


def first_attempt() -> bool:
    """Neither torchrun nor Slurm has restarted this run's workers yet."""
    return all(os.environ.get(v, "0") == "0" for v in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))


def hang_after_step(step: int) -> Hooks:
    def on_step_end(job, result):
        if result.step == step and job.world.rank == 1 and first_attempt():
            hang_forever()

    return Hooks(on_step_end=on_step_end)


def hang_on_host(host_and_step: list) -> Hooks:
    host, step = host_and_step

    def on_step_end(job, result):
        if result.step == step and job.world.rank == 1 and socket.gethostname() == host:
            hang_forever()

    return Hooks(on_step_end=on_step_end)


def hang_in_setup(_: bool) -> Hooks:
    def on_setup(job):
        if job.world.rank == 1 and first_attempt():
            hang_forever()

    return Hooks(on_setup=on_setup)


def hang_forever() -> None:
    """The stuck frame the hang watchdog's stack dump must name."""
    threading.Event().wait()


def offload_probe(directory: str) -> Hooks:
    counts = {"entered": 0, "packed": 0, "unpacked": 0}

    def counting(offload):
        def counted(enabled, device):
            context = offload(enabled, device)
            pack, unpack = getattr(context, "pack_hook", None), getattr(context, "unpack_hook", None)
            if pack is None:  # offload off: a null context
                return context
            counts["entered"] += 1

            def packed(tensor):
                counts["packed"] += 1
                return pack(tensor)

            def unpacked(saved):
                counts["unpacked"] += 1
                return unpack(saved)

            context.pack_hook, context.unpack_hook = packed, unpacked
            return context

        return counted

    def on_setup(job):
        job.contexts = replace(job.contexts, offload_context=counting(job.contexts.offload_context))
        out = Path(directory) / f"offload-rank{os.environ.get('RANK', '0')}.json"
        atexit.register(lambda: out.write_text(json.dumps(counts)))

    return Hooks(on_setup=on_setup)


def sample_probe(directory: str) -> Hooks:
    def on_setup(job):
        data, out = job.train_data, Path(directory) / f"samples-rank{os.environ.get('RANK', '0')}.jsonl"
        read = data.micro_batches

        def recorded(step):
            ids = [j for micro in data.sample_ids(step) for j in micro]
            with open(out, "a") as f:
                f.write(json.dumps({"step": step + 1, "dp_rank": data.dp_rank, "ids": ids}) + "\n")
            return read(step)

        data.micro_batches = recorded  # this instance only: the loop reads it through job.train_data

    return Hooks(on_setup=on_setup)


FAULTS = {f.__name__: f for f in (nan_at_step, inf_at_step, stop_after_step, die_before_commit, hang_after_step,
                                  hang_in_setup, hang_on_host, offload_probe, sample_probe)}
