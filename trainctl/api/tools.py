"""Export, generate and eval run their torch part as `python -m` children (this side of the wall stays torch-free);
data preparation runs here. Each checks its arguments first and returns the child's exit code or the dataset."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from trainctl.api.configs import find_run
from trainctl.core.errors import UserError

EXPORT_DTYPES = ("fp32", "bf16", "fp16")  # models/export.EXPORT_DTYPES' keys (that module imports torch)


def export(run: str | Path, *, checkpoint: str | None = None, out_dir: str | None = None,
           max_shard_size: str | None = None, dtype: str | None = None, verify: bool = False, merged: bool = False,
           adapter: bool = False, runs_dir: Path | str | None = None) -> int:
    """Write a verified checkpoint's model as safetensors (a LoRA run: `merged` weights or a PEFT `adapter`).

    The exporter prints its own one-line errors (exit 2) and warnings; its exit code is returned.
    """
    if out_dir is not None and not out_dir.strip():
        raise UserError(["--out '': empty; name a new folder, e.g. --out exports/mymodel"])
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise UserError([f"--dtype {dtype}: not an export dtype; use one of {', '.join(EXPORT_DTYPES)} "
                         "(quantized formats are not written)"])
    if merged and adapter:
        raise UserError(["--merged and --adapter: pick one (full weights, or a PEFT adapter folder)"])
    options = {"--checkpoint": checkpoint, "--out": out_dir, "--max-shard-size": max_shard_size, "--dtype": dtype}
    flags = {"--verify": verify, "--merged": merged, "--adapter": adapter and not merged}
    return worker_module("trainctl.models.export", find_run(run, runs_dir), options, flags)


def generate(run: str | Path, *, prompt: str | None = None, prompts: str | None = None,
             prompt_ids: str | None = None, checkpoint: str | None = None, max_new_tokens: int = 128,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, chat: bool = False,
             device: str | None = None, runs_dir: Path | str | None = None) -> int:
    """Continue exactly one of a prompt, a file of prompts or token ids with a run's checkpoint on one device."""
    given = [key for key, value in (("--prompt", prompt), ("--prompts", prompts), ("--prompt-ids", prompt_ids))
             if value is not None]
    if len(given) != 1:
        raise UserError([f"{' and '.join(given) or 'no prompt'}: give exactly one of --prompt TEXT, "
                         "--prompts FILE or --prompt-ids 1,2,3"])
    run_dir = find_run(run, runs_dir)
    if prompts is not None:
        _regular_file("--prompts", prompts)
    options = {"--prompt": prompt, "--prompts": prompts, "--prompt-ids": prompt_ids, "--checkpoint": checkpoint,
               "--max-new-tokens": max_new_tokens, "--temperature": temperature, "--top-p": top_p, "--seed": seed,
               "--device": device}
    return worker_module("trainctl.models.generate", run_dir, options, {"--chat": chat})


def evaluate(run: str | Path, data: str, *, checkpoint: str | None = None, batches: int | None = None,
             as_json: bool = False, device: str | None = None, runs_dir: Path | str | None = None) -> int:
    """Loss and perplexity of a checkpoint over a prepared dataset's val split."""
    if batches is not None and batches < 1:
        raise UserError([f"--batches {batches}: must be at least 1"])
    options = {"--data": data, "--checkpoint": checkpoint, "--batches": batches, "--device": device}
    return worker_module("trainctl.train.evaluate", find_run(run, runs_dir), options, {"--json": as_json})


def worker_module(module: str, run_dir: Path, options: dict[str, object], flags: dict[str, bool]) -> int:
    """Run `python -m MODULE RUN_DIR --option value... --flag...` (it imports torch); its exit code. It prints its
    own output and one-line errors (exit 2) on this process's stdout and stderr."""
    args = [sys.executable, "-m", module, str(run_dir)]
    for flag, value in options.items():
        args += [flag, str(value)] if value is not None else []
    args += [flag for flag, on in flags.items() if on]
    return subprocess.run(args).returncode


def _regular_file(key: str, path: str) -> None:
    """A named input that is not a regular file (a FIFO would block the reader forever) is refused here."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise UserError([f"{key} {path}: {exc.strerror or exc}; pass a text file, one prompt per line"]) from None
    if not stat.S_ISREG(mode):
        raise UserError([f"{key} {path}: not a regular file; pass a text file, one prompt per line"])


def prepare_data(inputs: Sequence[str], out_dir: str, *, progress: Callable[[int, int | None], None] | None = None,
                 data_format: str = "text", messages_field: str = "messages", prompt_field: str = "prompt",
                 completion_field: str = "completion", max_doc_tokens: int | None = None, overlong: str = "refuse",
                 **options):
    """Tokenize text into a token dataset (data.datasets=[DIR]); its metadata. `options`: data.prepare.prepare's
    (tokenizer, train_tokenizer, vocab_size, eos_token, text_field, val_fraction, shard_tokens, workers,
    chat_template)."""
    from trainctl.data.chat import RecordOptions
    from trainctl.data.prepare import DatasetError
    from trainctl.data.prepare import prepare as tokenize

    records = RecordOptions(data_format, messages_field, prompt_field, completion_field, None, max_doc_tokens,
                            overlong)
    try:
        return tokenize(list(inputs), out_dir, progress=progress, records=records, **options)
    except DatasetError as exc:
        raise UserError([str(exc)]) from None
