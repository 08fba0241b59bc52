"""What model a checkpoint holds, saved with it (meta.json's "model") and checked wherever a checkpoint is read.

A checkpoint's tensors do not say which model they are: rope_theta, norm_eps, the rope scaling or LoRA's alpha
change what the same tensors compute, and a config.yaml edited after training (or another run's checkpoint read
under this run's config) would load without a word. Resume, export, generate and eval compare the record with
the config they build the model from and refuse, in one line naming the keys, a model that is not the one saved.

Keys that do not change what the saved tensors compute are left out: the option's name, the folder a shape was
read from (model.path: a folder may move), max_seq_len (positions past it are refused, not computed otherwise)
and LoRA's dropout (training only). Checkpoints saved before the record was kept have none: nothing to compare.
"""

from __future__ import annotations

import json
from dataclasses import asdict

KEY = "model"  # meta.json's key
# The way out of a resume under another model (the run directory's config file named by the reader's caller).
RESUME_FIX = ("resume with the config the run was saved with (restore {config}), or start a new run from its "
              "weights with checkpoint.resume=RUN_DIR checkpoint.load_only=model")
UNCHECKED = ("name", "path", "max_seq_len")
LORA_KEYS = ("rank", "alpha", "targets")


def record(m) -> dict:
    """The model config's keys that decide what its tensors compute (`m`: a ModelConfig), JSON-ready."""
    fields = {k: v for k, v in asdict(m).items() if k not in UNCHECKED}
    fields["lora"] = {k: fields["lora"][k] for k in LORA_KEYS} if m.lora.rank > 0 else {"rank": 0}
    if m.lora.rank > 0 and m.lora.base_dtype != "fp32":  # a 4-bit base: its tensors are NF4 (records before it: fp32)
        fields["lora"]["base_dtype"] = m.lora.base_dtype
    return json.loads(json.dumps(fields))  # the form meta.json gives back (lists, floats)


def differences(saved: dict | None, m, base_only: bool = False) -> list[str]:
    """`model.KEY=NOW (saved: THEN)` for each key that differs; none when nothing was saved.

    base_only: compare the base model alone (a run starting from another's weights may add or drop LoRA)."""
    if not isinstance(saved, dict):
        return []
    now = record(m)
    keys = [k for k in now if not (base_only and k == "lora")]
    return [f"model.{k}={_shown(now[k])} (saved: {_shown(saved.get(k))})" for k in keys if saved.get(k) != now[k]]


def _shown(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_shown(v)}" for k, v in value.items()) + "}"
    return "absent" if value is None else str(value)


def refusal(where: str, saved: dict | None, m, fix: str, base_only: bool = False) -> str | None:
    """One line when the model config differs from the checkpoint's record, else None."""
    differ = differences(saved, m, base_only)
    if not differ:
        return None
    more = f" (and {len(differ) - 3} more)" if len(differ) > 3 else ""
    return f"{where}: saved from another model than the config describes: {', '.join(differ[:3])}{more}; {fix}"


def saved_lora_rank(saved: dict | None) -> int:
    """The LoRA rank a record says its checkpoint holds adapters of (0: none, or no record)."""
    lora = saved.get("lora") if isinstance(saved, dict) else None
    rank = lora.get("rank", 0) if isinstance(lora, dict) else 0
    return rank if isinstance(rank, int) else 0


def lora_left_behind(path, rank: int) -> str:
    """A run without LoRA starting from a LoRA run's checkpoint: one line naming what would be lost, and the way."""
    rank_text = f"rank {rank} " if rank > 0 else ""
    return (f"checkpoint.resume={path}: it holds LoRA adapters ({rank_text}trained by its run) that a run without "
            "LoRA would not load, starting from the base weights; export that run with the adapters folded in "
            "(trainctl export RUN --merged --out DIR) and start from it with checkpoint.init_from=DIR, or keep "
            "model.lora as that run had it")
