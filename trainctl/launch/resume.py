"""`trainctl resume NAME [OVERRIDES]`: continue a run from its newest checkpoint, with its own config or changed keys.

A resume is checked like a launch before anything is written: the run's config.yaml is validated again (a
hand-edited file gets one line per problem, not an assertion in the worker), the overrides are applied to it
and checked, and the keys that would make the continuation something else than this run (the model, the data
and its order, the global batch) are refused. The world size and the parallel split may change (reshard.py):
the checkpoint is resharded, the data continues at the same global sample, the grad accumulation keeps the global
batch. `train.steps=N` extends a finished run: its result is kept under RUN_DIR/history/ and the run continues
from its final checkpoint; the schedule note says what the learning rate does from there and warns when it would
jump.

Nothing here writes until `apply` (called holding the run's lock); the earlier files are kept in history/.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainctl.config.errors import ConfigError
from trainctl.config.load import escape_interpolations, from_dict, load_run_config, to_yaml, typed_merge
from trainctl.config.schema import GROUPS, RunConfig
from trainctl.config.validate import resolve
from trainctl.core import checkpoints
from trainctl.core import rundir as layout
from trainctl.core.batch_ramp import BatchRamp
from trainctl.launch import reshard, start_point
from trainctl.launch.errors import LaunchError
from trainctl.plan.schedule import continuation

# Keys a resume keeps: the model, the data and the order it is read in (with the global batch), the precision,
# where it runs, and the optimizer (its checkpointed states are that optimizer's: AdamW's moments do not load into
# Adafactor). Changing one would not continue this run; a new run can start from its checkpoint
# (checkpoint.resume=PATH). The world size and the parallel split may change: DCP reshards (see reshard.py).
FROZEN = ("model.", "data.", "precision.", "optim.name", "train.seq_len", "train.global_batch",
          "train.batch_ramp.",
          "train.seed", "cluster.launcher", "cluster.device",
          "checkpoint.resume", "checkpoint.load_only", "checkpoint.init_from", "name", "recipe", "runs_dir")
NEW_RUN_HINT = "launch a new run starting from this one's checkpoint with checkpoint.resume=RUN_DIR"
# A LoRA key changes the adapters' shapes (or drops them): no checkpoint of this run loads into the new model, so
# the trained adapters are folded into full weights first and a new run starts from those.
LORA_HINT = ("to train with another model.lora, fold this run's adapters in first (trainctl export RUN --merged "
             "--out DIR), then launch a new run with checkpoint.init_from=DIR and the new model.lora keys")


def new_run_hint(key: str) -> str:
    return LORA_HINT if key.startswith("model.lora.") else NEW_RUN_HINT


@dataclass
class Resumption:
    """A checked resume: the config to train with, where it continues, and what the user should know."""

    run_dir: Path
    cfg: RunConfig  # what config.yaml will hold: resolved, with the run's own model.path and init_from
    resolved: RunConfig  # the validated, derived config the plan is made from
    overrides: list[str]
    step: int | None  # the newest committed checkpoint's step, None: from the start
    finished: bool  # the run had written result.json
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def frozen(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in FROZEN)


def load(run_dir: Path) -> RunConfig:
    """The run's config.yaml, or one line saying why it does not load."""
    try:
        return load_run_config(run_dir)
    except ConfigError as exc:
        raise ConfigError([f"{run_dir / layout.CONFIG}: {problem}" for problem in exc.problems]) from None
    except Exception as exc:  # a damaged file: OmegaConf's and YAML's errors have no common base
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        key = getattr(exc, "full_key", None)
        raise ConfigError([f"{run_dir / layout.CONFIG} does not load ({f'{key}: ' if key else ''}{first}); "
                           "fix it, restore it from a copy, or launch a new run"]) from None


def _parsed(overrides: list[str]):
    try:
        return OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as exc:
        first = str(exc).strip().splitlines()[0]
        raise ConfigError([f"{first}; a resume takes key=value overrides, e.g. train.steps=2000"]) from None
    except RecursionError:  # the grammar's parser recurses once per nesting level: `[[[...1]]]` thousands deep
        raise ConfigError(["an override nests too deeply to parse; a resume takes key=value overrides, "
                           "e.g. train.steps=2000"]) from None


def _override_problem(o) -> str | None:
    key = o.key_or_group
    if o.is_sweep_override():
        return f"{o.input_line}: several values; a resume continues one run"
    if o.is_add() or o.is_delete() or o.is_force_add() or o.package is not None:
        return f"{o.input_line}: a resume changes existing keys only (key=value), e.g. train.steps=2000"
    if key in (*GROUPS, "recipe"):
        return f"{o.input_line}: a resume keeps the run's {key}; {NEW_RUN_HINT}"
    if frozen(key):
        return f"{o.input_line}: a resume keeps {key} (the model, the data and its order); {new_run_hint(key)}"
    return None


def apply_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """`cfg` with `key=value` overrides set, type-checked against the schema; ConfigError lists every problem."""
    parsed = _parsed(overrides)
    problems = [p for o in parsed if (p := _override_problem(o))]
    if problems:
        raise ConfigError(problems)
    node, _ = typed_merge(escape_interpolations(dataclasses.asdict(cfg)))
    for o in parsed:
        try:
            OmegaConf.update(node, o.key_or_group, o.value(), merge=False)
        except OmegaConfBaseException as exc:
            problems.append(f"{o.input_line}: {_first_line(exc)}")
    if problems:
        raise ConfigError(problems)
    try:
        return from_dict(node)
    except OmegaConfBaseException as exc:
        raise ConfigError([f"{' '.join(overrides)}: {_first_line(exc)}"]) from None


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def for_validation(cfg: RunConfig, from_checkpoint: bool) -> RunConfig:
    """What to validate: a run continuing from its own checkpoint never reads its Hugging Face source again, so a
    moved or deleted model.path / checkpoint.init_from folder does not stop it (its shape is in config.yaml)."""
    if not from_checkpoint or not (cfg.model.path or cfg.checkpoint.init_from):
        return cfg
    model = dataclasses.replace(cfg.model, path="", name=cfg.model.name if cfg.model.name != "hf" else "hf-import")
    return dataclasses.replace(cfg, model=model, checkpoint=dataclasses.replace(cfg.checkpoint, init_from=""))


def _validated(cfg: RunConfig, from_checkpoint: bool, where: str) -> RunConfig:
    try:
        return resolve(for_validation(cfg, from_checkpoint))
    except ConfigError as exc:
        raise ConfigError([f"{where}: {p}" for p in exc.problems]) from None


def flat(cfg: RunConfig) -> dict[str, object]:
    """Every leaf of a config as `group.key` -> value (lists and maps as values)."""
    out: dict[str, object] = {}

    def walk(node, prefix: str) -> None:
        for f in dataclasses.fields(node):
            value, key = getattr(node, f.name), f"{prefix}{f.name}"
            if dataclasses.is_dataclass(value):
                walk(value, f"{key}.")
            else:
                out[key] = value

    walk(cfg, "")
    return out


def frozen_changes(before: RunConfig, after: RunConfig) -> list[str]:
    a, b = flat(before), flat(after)
    return [f"{k}: {a[k]!r} -> {b[k]!r}: a resume keeps it; {new_run_hint(k)}"
            for k in a if frozen(k) and a[k] != b[k]]


def newest_step(run_dir: Path) -> int | None:
    committed = checkpoints.list_committed(checkpoints.checkpoint_dir(run_dir))
    return committed[-1][0] if committed else None


def check(run_dir: Path, overrides: list[str]) -> Resumption:
    """Everything a resume of `run_dir` with `overrides` needs to know; raises a UserError before any write."""
    old = load(run_dir)
    step, finished = newest_step(run_dir), layout.result(run_dir) is not None
    where = f"{run_dir / layout.CONFIG}" + (" with the overrides" if overrides else "")
    old_resolved = _validated(old, step is not None, str(run_dir / layout.CONFIG))
    cfg = apply_overrides(old, overrides) if overrides else old
    if overrides:  # another world or split: the data-parallel degree and the batch split are derived anew
        cfg = reshard.relayout(old_resolved, cfg, {o.key_or_group for o in _parsed(overrides)})
    resolved = _validated(cfg, step is not None, where) if overrides else old_resolved
    if problems := frozen_changes(old_resolved, resolved):
        raise ConfigError(problems)
    steps = resolved.train.steps
    if finished and (not overrides or steps <= old.train.steps):
        raise LaunchError(f"run {run_dir.name} already finished at step {old.train.steps} (see "
                          f"{run_dir / layout.RESULT}); to train further: trainctl resume {run_dir.name} "
                          f"train.steps=N with N > {old.train.steps}")
    if finished and step is None:
        raise LaunchError(f"run {run_dir.name} finished without a checkpoint to continue from "
                          "(checkpoint.save_final=false); launch a new run")
    if step is not None and steps < step:
        raise ConfigError([f"train.steps={steps}: the run's newest checkpoint is at step {step}; "
                           f"use train.steps >= {step}"])
    if problems := start_point.own_problems(run_dir, resolved):
        raise ConfigError(problems)
    # config.yaml holds the resolved config, with the run's own model source (the check above set it aside).
    written = dataclasses.replace(resolved, model=old.model, checkpoint=dataclasses.replace(
        resolved.checkpoint, init_from=old.checkpoint.init_from))
    res = Resumption(run_dir, written, resolved, list(overrides), step, finished)
    if step is not None and (resharding := reshard.note(old_resolved, resolved)):
        res.notes.append(resharding)
    _schedule_notes(res, old)
    return res


def _schedule_notes(res: Resumption, old: RunConfig) -> None:
    if res.step is None or not res.overrides:
        return
    new = res.resolved
    note, jump = continuation(res.step, (old.optim.lr, old.schedule, old.train.steps),
                              (new.optim.lr, new.schedule, new.train.steps),
                              (BatchRamp.of(old.train), BatchRamp.of(new.train)))  # a ramp's lr counts tokens
    res.notes.append(note)
    if jump:
        res.warnings.append(jump)
    if res.finished and res.step < old.train.steps:
        res.warnings.append(f"the newest checkpoint is at step {res.step}, before the run's end at step "
                            f"{old.train.steps}: steps {res.step + 1}-{old.train.steps} are trained again")


def apply(res: Resumption, plan_record: dict) -> None:
    """Write the resumed config: the earlier config, plan and result move to RUN_DIR/history/ first."""
    if not res.overrides:
        return
    run_dir = res.run_dir
    history = run_dir / layout.HISTORY
    history.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for name in (layout.CONFIG, layout.PLAN, layout.OVERRIDES):
        if (run_dir / name).is_file():
            shutil.copy2(run_dir / name, history / f"{stamp}-{name}")
    _write_text(run_dir / layout.CONFIG, to_yaml(res.cfg))
    layout.write_json_atomic(run_dir / layout.PLAN, plan_record)
    with open(run_dir / layout.OVERRIDES, "a") as f:
        f.write(f"# resume {stamp}\n" + "".join(f"{o}\n" for o in res.overrides))
    if res.finished:  # the run continues: it has not finished any more, its result moves to the history
        os.replace(run_dir / layout.RESULT, history / f"{stamp}-{layout.RESULT}")


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
