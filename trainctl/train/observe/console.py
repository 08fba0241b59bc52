"""The worker's console lines: one short line per record, under 100 columns (metrics.jsonl keeps every field,
TensorBoard and W&B the loss scale and peak memory too).

    step 20/100  loss 2.5670  lr 2.9e-03  grad 0.691  8.71k tok/s  0.47 s/step
    eval step 25  val loss 2.4920
"""

from __future__ import annotations

MIB = 2**20
SEP = "  "


def _count(n: float) -> str:
    return f"{n / 1e6:.3g}M" if n >= 1e6 else f"{n / 1e3:.3g}k" if n >= 1e3 else f"{n:.0f}"


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / MIB:.1f} MiB"


def _train(r: dict, total: int | None) -> str:
    parts = [f"step {r['step']}/{total}" if total else f"step {r['step']}", f"loss {r['loss']:.4f}"]
    if "lr" in r:
        parts.append(f"lr {r['lr']:.1e}")
    if "grad_norm" in r:
        parts.append(f"grad {r['grad_norm']:.3g}")
    if "tokens_per_s" in r:
        parts.append(f"{_count(r['tokens_per_s'])} tok/s")
    if "step_time_s" in r:
        parts.append(f"{r['step_time_s']:.3g} s/step")
    if "mfu" in r:
        parts.append(f"mfu {r['mfu']:.1%}")
    for key, word in (("guard_skipped_steps", "skipped"), ("guard_loss_spikes", "spikes"),
                      ("guard_empty_batches", "empty batches")):
        if r.get(key):
            parts.append(f"{word} {r[key]}")
    return SEP.join(parts)


def _no_targets(record: dict) -> str:
    """Why a val loss is nan when no val target counted (chat or instruction data whose val answers are all masked)."""
    if record.get("val_targets") != 0:
        return ""
    return (" (no val token counts in the loss: the val batches hold prompts only, every answer masked; prepare "
            "with a larger --val-fraction, or train.eval_every=0)")


def _final(r: dict) -> str:
    parts = [f"final step {r.get('steps')}"]
    if r.get("final_train_loss") is not None:
        parts.append(f"loss {r['final_train_loss']:.4f}")
    if r.get("final_val_loss") is not None and r.get("initial_val_loss") is not None:
        parts.append(f"val loss {r['initial_val_loss']:.4f} -> {r['final_val_loss']:.4f}")
    if r.get("wall_time_s") is not None:
        parts.append(f"{r['wall_time_s']:.0f} s")
    if r.get("stopped"):
        parts.append("stopped")
    return SEP.join(parts)


def _memory(r: dict) -> str:
    parts = [f"memory step {r['step']}"]
    if r.get("peak_bytes") is not None:
        parts.append(f"step peak {_size(r['peak_bytes'])} ({r.get('peak_source', '?')})")
    states = sum(r.get(k) or 0 for k in ("params_bytes", "grads_bytes", "optimizer_bytes"))
    if states:
        parts.append(f"states {_size(states)}")
    if r.get("rss_peak_bytes"):
        parts.append(f"rss {_size(r['rss_peak_bytes'])}")
    return SEP.join(parts)


def _checkpoint(r: dict) -> str:
    text = f"checkpoint step {r['step']}"
    if r.get("bytes") is not None and r.get("total_s") is not None:
        text += f"{SEP}{_size(r['bytes'])} in {r['total_s']:.2f} s"
    if r.get("blocking_s") is not None:
        text += f" (blocking {r['blocking_s']:.2f} s)"
    return text


def _fields(r: dict) -> str:
    """Any other record as key=value (lists and dicts stay in metrics.jsonl only)."""
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                    if not isinstance(v, (list, dict)))


def _eval_pairs(r: dict) -> str:
    """A preference run's held-out pair metrics, when its eval record has them."""
    if "reward_accuracy" not in r:
        return ""
    return f"{SEP}pair accuracy {r['reward_accuracy']:.1%}{SEP}margin {r['reward_margin']:.4g}"


def console_line(record: dict, total_steps: int | None = None) -> str:
    kind = record.get("kind")
    try:
        if kind == "train":
            return _train(record, total_steps)
        if kind == "eval":
            return (f"eval step {record['step']}{SEP}val loss {record['val_loss']:.4f}{_no_targets(record)}"
                    + _eval_pairs(record))
        if kind == "final":
            return _final(record)
        if kind == "memory":
            return _memory(record)
        if kind == "checkpoint":
            return _checkpoint(record)
        if kind == "resume":
            seen = f" ({record['samples_seen']:,} samples seen)" if "samples_seen" in record else ""
            return f"resumed at step {record['step']} from {record.get('checkpoint')}{seen}"
    except (KeyError, TypeError, ValueError):
        pass  # a record of an unexpected shape is still shown, field by field
    return _fields(record)
