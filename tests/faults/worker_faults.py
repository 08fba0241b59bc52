"""Faults and probes the tests inject into the worker, from test-side code only (nothing in trainctl/ knows).

A test asks for them through the environment of the processes it starts (`fault_env`): TRAINCTL_FAULTS holds
{name: argument} as JSON, and this folder goes first on PYTHONPATH, so that its sitecustomize.py runs at every
interpreter start. When TRAINCTL_FAULTS is set there, it installs an import hook that patches each worker module
right after it is first imported (before any other module binds its names); launchers and the torchrun agent
never import those modules, so nothing heavy is imported there. In-process tests call `install` directly.

    nan_at_step: N        the training loss of step N (1-based, as logged) is multiplied by NaN before backward,
                          on every micro-batch, plain or pipeline: the gradients are NaN too
    inf_at_step: N        fp16: the loss fed to backward is multiplied by inf at the N-th optimizer step (0-based)
                          this process runs, forcing an overflow; the reported loss stays the true one
    stop_after_step: N    every rank acts as if a stop were requested after step N (no signal: exit code 0)
    die_before_commit: N  every rank SIGKILLs itself once every file of checkpoint N is written, before the
                          commit (first attempt under torchrun only)
    offload_probe: DIR    count the saved-tensor packs/unpacks of the activation-offload context the worker enters;
                          each rank writes DIR/offload-rank{RANK}.json at exit
"""

from __future__ import annotations

import atexit
import importlib.abc
import json
import math
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

FAULTS_ENV = "TRAINCTL_FAULTS"
HERE = Path(__file__).resolve().parent

Setter = Callable[[object, str, object], None]  # setattr, or pytest's monkeypatch.setattr


def fault_env(**faults: object) -> dict[str, str]:
    """The environment variables that give a started worker these faults (merge into its environment)."""
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, FAULTS_ENV: json.dumps(faults)}


# --- the faults: each patches one or more worker modules ---------------------------------------------

_current_step: list[int | None] = [None]  # the 0-based step train_step is running, else None


def _track_step(module, set_attr: Setter) -> None:
    train_step = module.train_step

    def tracked(job, step):
        _current_step[0] = step
        try:
            return train_step(job, step)
        finally:
            _current_step[0] = None

    set_attr(module, "train_step", tracked)


def nan_at_step(step: int) -> dict[str, Callable]:
    def poison_loss(module, set_attr: Setter) -> None:
        normalize = module.TokenLoss.normalize  # both paths' training loss goes through it

        def poisoned(self, summed):
            loss = normalize(self, summed)
            return loss * float("nan") if _current_step[0] == step - 1 else loss

        set_attr(module.TokenLoss, "normalize", poisoned)

    return {"trainctl.train.loop.loss": poison_loss, "trainctl.train.loop.step": _track_step}


def inf_at_step(step: int) -> dict[str, Callable]:
    def overflow(module, set_attr: Setter) -> None:
        cls = module.DynamicLossScaler
        scale, step_fn = cls.scale, cls.step

        def scaled(self, loss):
            if getattr(self, "_fault_steps_run", 0) == step:
                loss = loss * math.inf
            return scale(self, loss)

        def stepped(self, optimizer):
            step_fn(self, optimizer)
            self._fault_steps_run = getattr(self, "_fault_steps_run", 0) + 1

        set_attr(cls, "scale", scaled)
        set_attr(cls, "step", stepped)

    return {"trainctl.train.loop.loss_scaling": overflow}


def stop_after_step(step: int) -> dict[str, Callable]:
    def stop_there(module, set_attr: Setter) -> None:
        wanted = module.StopRequest.wanted
        set_attr(module.StopRequest, "wanted", lambda self, done: wanted(self, done) or done == step)

    return {"trainctl.train.loop.stop": stop_there}


def die_before_commit(step: int) -> dict[str, Callable]:
    def die(module, set_attr: Setter) -> None:
        commit = module.CheckpointManager._commit

        def dying(self, at, tmp, part, *args):
            if at == step and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
                self._all_gather(part)  # every rank has written its files and reported them
                os.kill(os.getpid(), signal.SIGKILL)
            return commit(self, at, tmp, part, *args)

        set_attr(module.CheckpointManager, "_commit", dying)

    return {"trainctl.train.checkpoint.store": die}


def offload_probe(directory: str) -> dict[str, Callable]:
    counts = {"entered": 0, "packed": 0, "unpacked": 0}

    def count(module, set_attr: Setter) -> None:
        offload = module.activation_offload

        def counted(enabled, device):
            context = offload(enabled, device)
            pack, unpack = getattr(context, "pack_hook", None), getattr(context, "unpack_hook", None)
            if pack is None:
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

        set_attr(module, "activation_offload", counted)
        out = Path(directory) / f"offload-rank{os.environ.get('RANK', '0')}.json"
        atexit.register(lambda: out.write_text(json.dumps(counts)))

    return {"trainctl.train.parallel.activations": count}


FAULTS = {f.__name__: f for f in (nan_at_step, inf_at_step, stop_after_step, die_before_commit, offload_probe)}


# --- installing them -----------------------------------------------------------------------------------

def patches_of(faults: dict) -> dict[str, list[Callable]]:
    """module name -> the patches to apply to it, for {fault name: argument}."""
    by_module: dict[str, list[Callable]] = {}
    for name, argument in faults.items():
        for module, patch in FAULTS[name](argument).items():
            by_module.setdefault(module, []).append(patch)
    return by_module


def install(faults: dict, set_attr: Setter = setattr) -> None:
    """Patch now what is imported already, and every other module right after its first import."""
    pending = {}
    for module, patches in patches_of(faults).items():
        if module in sys.modules:
            for patch in patches:
                patch(sys.modules[module], set_attr)
        else:
            pending[module] = patches
    if pending:
        sys.meta_path.insert(0, _PatchAfterImport(pending, set_attr))


def install_from_env() -> None:
    faults = os.environ.get(FAULTS_ENV)
    if faults:
        install(json.loads(faults))


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader another finder returns, to patch the module after it runs."""

    def __init__(self, pending: dict[str, list[Callable]], set_attr: Setter):
        self.pending, self.set_attr = pending, set_attr

    def find_spec(self, name, path, target=None):
        if name not in self.pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, self.pending.pop(name), self.set_attr)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, patches: list[Callable], set_attr: Setter):
        self.loader, self.patches, self.set_attr = loader, patches, set_attr

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        for patch in self.patches:
            patch(module, self.set_attr)

    def __getattr__(self, name):  # get_source, get_filename, ...: the real loader's
        return getattr(self.loader, name)
