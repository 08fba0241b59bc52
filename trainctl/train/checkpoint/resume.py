"""Where a run starts: the glue between the loop and checkpoint.py (what a checkpoint holds: state.py).

Start: a run's own newest valid checkpoint always wins (a restart after a crash, a requeue)
unless `checkpoint.resume=never` (every start is step 0);
otherwise `checkpoint.resume` names another run's checkpoint or run directory to start from
(e.g. fine-tuning), restoring `checkpoint.load_only` of it: all (model, optimizer, step and
data position), model_optim (a fresh step 0 with the optimizer's moments) or model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from trainctl.config.schema import CheckpointConfig, ModelConfig
from trainctl.core import model_record, rundir
from trainctl.core.lora import is_adapter
from trainctl.models.qlora import saved_nf4
from trainctl.train.checkpoint import state
from trainctl.train.checkpoint.store import META, CheckpointError, CheckpointManager, checkpoint_dir
from trainctl.train.errors import WorkerConfigError

log = logging.getLogger("trainctl.train")

# What each load_only choice restores (the DCP parts; "all" also the step, data position and RNG).
_PARTS = {"all": ("model", "optim"), "model_optim": ("model", "optim"), "model": ("model",)}


@dataclass
class StartPoint:
    """Where the loop begins: step 0 of a fresh run, or the state of a checkpoint."""

    step: int = 0
    samples_seen: int = 0
    path: Path | None = None
    meta: dict = field(default_factory=dict)
    data_state: dict | None = None  # this rank's stream position (data=hf), when the checkpoint holds one for it

    @property
    def resumed(self) -> bool:
        return self.step > 0


def find_source(cfg: CheckpointConfig, run_dir: Path, manager: CheckpointManager) -> tuple[Path | None, str]:
    """(checkpoint to start from, load_only), the same on every rank; (None, "all") for a fresh start."""
    if cfg.resume == "never":
        return None, "all"
    own = manager.latest_valid()
    if own is not None:
        return own, "all"
    if cfg.resume == "auto":
        return None, "all"
    source = Path(cfg.resume).expanduser()
    if (source / META).is_file():
        return source, cfg.load_only
    path = manager.latest_valid(checkpoint_dir(source)) if source.is_dir() else None
    if path is None:
        raise CheckpointError(
            f"checkpoint.resume={cfg.resume}: no committed checkpoint there; pass a step-NNNNNNNN directory or a "
            "run directory with checkpoints/, or use checkpoint.resume=auto"
        )
    return path, cfg.load_only


def fresh_adapters(path: Path, model) -> frozenset[str]:
    """LoRA adapters of the live model that the checkpoint lacks (a LoRA run from a full run's weights): they keep
    their init (B = 0: the run starts at those weights)."""
    from torch.distributed.checkpoint import FileSystemReader

    adapters = {n for n, _ in state.named_view(model).named_parameters() if is_adapter(_clean(n))}
    if not adapters:
        return frozenset()
    try:
        saved = {k.removeprefix("model.") for k in FileSystemReader(str(path)).read_metadata().state_dict_metadata}
    except Exception:  # noqa: BLE001 (unreadable metadata: manager.load reports it in its own words)
        return frozenset()
    missing = frozenset(n for n in adapters if _clean(n) not in saved)
    if missing:
        log.info("LoRA adapters start fresh: %d adapter tensors are not in %s", len(missing), path)
    return missing


def _clean(name: str) -> str:
    wrappers = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
    return ".".join(p for p in name.split(".") if p not in wrappers)


def check_model(path: Path, load_only: str, live: ModelConfig) -> None:
    """Refuse a checkpoint of another model than the config's (core/model_record.py), and a start without LoRA
    from a LoRA run's checkpoint: its trained adapters would be left behind, the run starting from the base."""
    saved = (rundir.read_json(path / META) or {}).get(model_record.KEY)
    if load_only == "all":
        line = model_record.refusal(f"checkpoint {path}", saved, live,
                                    model_record.RESUME_FIX.format(config=rundir.CONFIG))
        if line:
            raise WorkerConfigError(line)
        return
    rank = saved_adapters(path, saved) if live.lora.rank == 0 else 0
    if rank:
        raise WorkerConfigError(model_record.lora_left_behind(path, rank))


def saved_adapters(path: Path, saved: dict | None) -> int:
    """The LoRA rank the checkpoint was saved with (its record, else: -1 when its tensors hold adapters, 0 not)."""
    if isinstance(saved, dict):
        return model_record.saved_lora_rank(saved)
    from torch.distributed.checkpoint import FileSystemReader

    try:
        keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception:  # noqa: BLE001 (unreadable metadata: manager.load reports it in its own words)
        return 0
    return -1 if any(is_adapter(_clean(k.removeprefix("model."))) for k in keys) else 0


def restore(manager: CheckpointManager, path: Path, load_only: str, model, optimizer, world_size: int,
            live: ModelConfig | None = None) -> StartPoint:
    """Load `path` into the live model/optimizer (resharding as needed); returns where to continue."""
    if live is not None:
        check_model(path, load_only, live)
    parts = _PARTS[load_only]
    skip = fresh_adapters(path, model) if load_only == "model" else frozenset()
    # Stateful parts in the current layout: DCP loads them (from any layout) into the live model and optimizer.
    nf4_source = saved_nf4(path) is not None  # QLoRA's base under FSDP2 reads into NF4 or fp32 (state.py)
    meta, own_rank_state = manager.load(path, state.app_state(model, optimizer, parts, skip, nf4_source))
    if load_only != "all":
        log.info("started from %s (%s only)", path, load_only)
        state.apply_rank_state(None, optimizer, load_optim=False)
        return StartPoint(path=path, meta=meta)
    state.apply_rank_state(own_rank_state, optimizer, load_optim="optim" in parts)
    if meta.get("world_size") != world_size:
        log.warning("resuming %s saved by %s ranks on %s ranks: weights and optimizer resharded, data position kept "
                    "in samples, RNG streams not restored", path, meta.get("world_size"), world_size)
    data_state = (own_rank_state or {}).get("data")
    return StartPoint(step=meta["step"], samples_seen=meta["samples_seen"], path=path, meta=meta, data_state=data_state)
