"""Export a checkpoint's model weights as safetensors for inference tools.

    python -m trainctl.models.export RUN_DIR OPTIONS_JSON [RESULT_JSON]

(`trainctl export` starts it so: the options are core/tool_options.ExportOptions as JSON; the report goes to
RESULT_JSON, or to stdout without one.)

Reads only the model tensors ("model.<fqn>" in the DCP metadata; never the optimizer
state) of a torch.distributed.checkpoint directory, in one process without a process
group; DCP reassembles tensors that FSDP/TP ranks saved in pieces. Tensors are read one
output shard at a time, so peak memory is about one shard, not the whole model.

Writes `model.safetensors`, or when the total exceeds the shard size,
`model-0000K-of-0000N.safetensors` plus `model.safetensors.index.json` (Hugging Face's
layout), and `config.json` as the family's transformers class reads it (plus `trainctl_model` and
`trainctl_checkpoint`). Names and the q/k rotary layout are Hugging Face's (models/hf.py), dtypes
those of the checkpoint unless --dtype casts them. Tied embeddings are saved once, as
`model.embed_tokens.weight`. When the run trained on a dataset prepared with a Hugging Face
tokenizer, its tokenizer.json (and a tokenizer_config.json) come along.

Only a verified checkpoint is read (trainctl.core.checkpoints: committed, and every file matches
its manifest): a named one that fails is refused; by default the newest valid one is taken and each
newer one skipped is named on stderr, with why.

The export is written to a temporary sibling folder and renamed into place, so a
folder at the output path is always complete; an existing non-empty one is refused.
Every failure the user can act on (not a run directory, no valid checkpoint, a checkpoint DCP
cannot read, an output path that cannot be written) prints one line, exits 2, and leaves nothing.

This module holds the command and the all-or-nothing output folder; checkpoint_reader.py reads the checkpoint
(generation and evaluation read it too) and hf_folder.py writes the files into the folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch
from safetensors import SafetensorError

from trainctl.config.load import load_run_config
from trainctl.config.schema import ModelConfig
from trainctl.core import checkpoints, hub, tool_options
from trainctl.core.tool_options import ExportOptions, ExportReport, ToolFailed, serve
from trainctl.models import lora_export
from trainctl.models.checkpoint_reader import (
    ExportError,
    check_against_config,
    find_checkpoint,
    first_line,
    model_entries,
    read_model_config,
    read_tensors,
)
from trainctl.models.hf_folder import run_tokenizer, write_config, write_tokenizer, write_weights
from trainctl.models.verify import Verified, VerifyError, verify_export

# The names are tool_options' (torch-free: the CLI checks --dtype against them); these are their torch dtypes.
EXPORT_DTYPES = dict(zip(tool_options.EXPORT_DTYPES, (torch.float32, torch.bfloat16, torch.float16), strict=True))


def default_out(run_dir: Path, ckpt: Path) -> Path:
    return run_dir / "export" / ckpt.name


def check_out(out: Path, run_dir: Path, ckpt: Path) -> None:
    """Refuse an output path that holds files, or lies inside a checkpoint (an extra file would fail verification)."""
    for inside in (checkpoints.checkpoint_dir(run_dir), ckpt):
        if out.resolve().is_relative_to(inside.resolve()):
            raise ExportError(f"--out {out}: inside {inside}: an extra file there fails the checkpoint's verification")
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out}: is a file, not a folder; remove it or choose another --out")
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out}: already exists and is not empty; remove it or pass --out DIR")


def missing_parents(path: Path) -> list[Path]:
    """The ancestors of `path` that do not exist yet, deepest first (created by the export, removed on failure)."""
    missing = []
    for parent in path.absolute().parents:
        if parent.exists():
            break
        missing.append(parent)
    return missing


def export(
    run_dir: Path, checkpoint: str | None = None, out: Path | None = None,
    max_shard_size: int = tool_options.DEFAULT_MAX_SHARD_SIZE, dtype: torch.dtype | None = None, verify: bool = False,
    lora_mode: str | None = None,
) -> tuple[Path, Verified | None]:
    """Export one verified checkpoint of `run_dir` (default: the newest valid one).

    Returns the output folder and, with `verify`, what the check against transformers found (models/verify.py);
    an export that fails the check is never moved to `out`.
    """
    cfg = read_model_config(run_dir)
    refuse_routing_bias(cfg)
    ckpt = find_checkpoint(run_dir, checkpoint)
    entries = model_entries(ckpt)
    names = check_against_config(entries, cfg, ckpt)
    lora_export.check_mode(cfg, lora_mode)
    if lora_mode == "adapter" and verify:
        raise ExportError("--verify loads full weights with transformers; use it with --merged, not --adapter")
    out = out or default_out(run_dir, ckpt)
    if not out.absolute().name or out.absolute() == Path.cwd():
        raise ExportError(f"--out {str(out) or repr('')}: the current folder or the filesystem root; name a new "
                          "folder, e.g. --out exports/mymodel")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    created = missing_parents(tmp)
    done = False
    tokens = run_tokenizer(run_dir)  # a damaged tokenizer record is refused before any file is written
    try:
        check_out(out, run_dir, ckpt)
        tmp.mkdir(parents=True)
        if lora_mode == "adapter":
            write_adapter_folder(run_dir, ckpt, entries, names, tmp, cfg, dtype, tokens)
            verified = None
        else:
            verified = write_full(ckpt, entries, names, tmp, max_shard_size, cfg, dtype, tokens, verify)
        tmp.rename(out)  # onto an empty folder or a free name; never a half-written folder at `out`
        done = True
    except (OSError, SafetensorError) as exc:  # writing the output; reads of the checkpoint raise ExportError
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else first_line(exc)
        raise ExportError(f"--out {out}: cannot write the export there: {reason}") from None
    finally:
        if not done:
            shutil.rmtree(tmp, ignore_errors=True)
            for parent in created:
                with contextlib.suppress(OSError):
                    parent.rmdir()
    return out, verified


def refuse_routing_bias(cfg: ModelConfig) -> None:
    """A run trained with aux-loss-free balancing routes through a learned per-expert bias that the Hugging Face
    classes have no place for: an export without it would pick other experts than the trained model (and --verify,
    comparing against a model built the same way, could not tell), so it is refused rather than written."""
    rate = cfg.moe.bias_update_rate
    if cfg.moe.num_experts and rate > 0:
        raise ExportError(f"model.moe.bias_update_rate={rate}: this run routes through a learned per-expert bias "
                          f"that the Hugging Face {cfg.family} class has no place for, so an export would route "
                          "differently; use trainctl generate / eval on the run, or train with bias_update_rate=0 "
                          "to export")


def write_full(ckpt: Path, entries: dict, names: list[str], out: Path, max_shard_size: int, cfg: ModelConfig,
               dtype: torch.dtype | None, tokens: dict | None, verify: bool) -> Verified | None:
    """The Hugging Face folder (a LoRA run's with its adapters merged); with `verify`, what the check found."""
    read = partial(read_tensors, ckpt, entries)
    if cfg.lora.rank > 0:
        read = lora_export.merged_reader(names, read, cfg.lora)
        names, cfg = lora_export.base_names(names), lora_export.base_config(cfg)
    write_weights(ckpt, entries, names, out, max_shard_size, cfg, dtype, read)
    write_config(cfg, ckpt, out, dtype or entries[names[0]][1].properties.dtype, tokens)
    write_tokenizer(tokens, cfg, out)
    return verify_export(out, read(names), cfg, dtype) if verify else None


def write_adapter_folder(run_dir: Path, ckpt: Path, entries: dict, names: list[str], out: Path, cfg: ModelConfig,
                         dtype: torch.dtype | None, tokens: dict | None) -> None:
    """A LoRA run's PEFT adapter folder (models/lora_export.py), with the run's tokenizer."""
    adapters = read_tensors(ckpt, entries, [n for n in names if n not in lora_export.base_names(names)])
    adapters = {n: t if dtype is None else t.to(dtype) for n, t in adapters.items()}
    init_from = load_run_config(run_dir).checkpoint.init_from
    pinned = hub.pin(init_from) if init_from else None  # a Hub model: its name, which peft and transformers fetch
    lora_export.write_adapter(adapters, cfg, out, pinned["name"] if pinned else init_from,
                              pinned["revision"] if pinned else None)
    write_tokenizer(tokens, cfg, out)


def run(run_dir: Path, options: ExportOptions) -> ExportReport:
    """Export as `options` say; what was written (raises UserError, or ToolFailed when --verify finds a
    difference: not the user's mistake, the conversion is wrong, and nothing was left at --out)."""
    if problems := options.problems():  # the api checked them; a direct `python -m` call is checked here too
        raise ExportError(problems)
    dtype = EXPORT_DTYPES[options.dtype] if options.dtype else None
    try:
        out, verified = export(run_dir, options.checkpoint, Path(options.out) if options.out else None,
                               options.shard_bytes, dtype, verify=options.verify, lora_mode=options.lora_mode)
    except VerifyError as exc:
        raise ToolFailed(f"export --verify failed, nothing written: {exc}") from None
    config = out / "config.json"  # a PEFT adapter folder has none
    step = json.loads(config.read_text())["trainctl_checkpoint"]["step"] if config.exists() else None
    figures = None if verified is None else {**asdict(verified), "tokens": list(verified.tokens)}
    note = lora_export.base_note(read_model_config(run_dir), options.lora_mode)
    return ExportReport(str(out), sorted(p.name for p in out.iterdir()), options.dtype, step, figures,
                        verified.line() if verified else None, note)


def main(argv: list[str] | None = None) -> int:
    """Child entry (`tool_options.child_argv`): 0 on success, 2 for a user error, 1 when --verify finds a
    difference."""
    return serve(ExportOptions, sys.argv[1:] if argv is None else argv, run)


if __name__ == "__main__":
    from trainctl.core.lean_process import exit_now

    exit_now(main())  # without the teardown of torch's modules (core/lean_process.py)
