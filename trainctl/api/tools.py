"""Export, generate and eval run their torch part as `python -m` children (this side of the wall stays torch-free);
data preparation runs here. Each checks its options (core/tool_options.py) before any child starts, hands them to
the child as JSON, and returns the value the child wrote back: an export report, the completions, an eval result.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from trainctl.api.arguments import checked
from trainctl.api.configs import find_run
from trainctl.core.errors import UserError
from trainctl.core.tool_options import (
    EvalOptions,
    EvalResult,
    ExportOptions,
    ExportReport,
    Generated,
    GenerateOptions,
    ToolFailed,
    child_argv,
)


@checked(options=ExportOptions)
def export(run: str | Path, options: ExportOptions | None = None, *, runs_dir: Path | str | None = None,
           **values) -> ExportReport:
    """Write a verified checkpoint's model as safetensors (a LoRA run: `merged` weights or a PEFT `adapter`).

    `values`: ExportOptions' fields, over `options`. Raises UserError for what the user can fix, ToolFailed
    when `verify` finds the export differs (nothing is written then).
    """
    options = replace(options or ExportOptions(), **values)
    _check(options)
    return ExportReport(**_run_child("trainctl.models.export", find_run(run, runs_dir), options))


@checked(options=GenerateOptions)
def generate(run: str | Path, options: GenerateOptions | None = None, *, runs_dir: Path | str | None = None,
             **values) -> Generated:
    """Continue exactly one of a prompt, a file of prompts or token ids with a run's checkpoint on one device.

    `values`: GenerateOptions' fields, over `options`."""
    options = replace(options or GenerateOptions(), **values)
    _check(options)
    run_dir = find_run(run, runs_dir)
    if options.prompts is not None:
        _regular_file("--prompts", options.prompts)
    return Generated.from_dict(_run_child("trainctl.models.generate", run_dir, options))


@checked(options=EvalOptions)
def evaluate(run: str | Path, options: EvalOptions | None = None, *, runs_dir: Path | str | None = None,
             **values) -> EvalResult:
    """Loss and perplexity of a checkpoint over a prepared dataset's val split.

    `values`: EvalOptions' fields (`data` is required), over `options`."""
    options = replace(options, **values) if options else EvalOptions(**values)
    _check(options)
    return EvalResult(**_run_child("trainctl.train.evaluate", find_run(run, runs_dir), options))


def _check(options: ExportOptions | GenerateOptions | EvalOptions) -> None:
    if problems := options.problems():
        raise UserError(problems)


def _run_child(module: str, run_dir: Path, options: object) -> dict:
    """Run the tool's torch child on `options`; the value it wrote back. Its warnings reach this process's stderr;
    its one-line error is raised here (UserError for exit 2, ToolFailed for exit 1)."""
    with tempfile.TemporaryDirectory(prefix="trainctl-tool-") as folder:
        result = Path(folder) / "answer.json"  # a temporary folder of its own, not the run directory
        code = subprocess.run(child_argv(module, run_dir, options, result)).returncode
        try:
            body = json.loads(result.read_text())
        except (OSError, ValueError):
            body = None
    if not isinstance(body, dict) or body.get("code") != code:
        raise ToolFailed(f"{module} ended with exit code {code} and no result; its output above says why")
    if code == 2:
        raise UserError(body["error"])
    if code != 0:
        raise ToolFailed(body["error"])
    return body["value"]


def _regular_file(key: str, path: str) -> None:
    """A named input that is not a regular file (a FIFO would block the reader forever) is refused here."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise UserError([f"{key} {path}: {exc.strerror or exc}; pass a text file, one prompt per line"]) from None
    if not stat.S_ISREG(mode):
        raise UserError([f"{key} {path}: not a regular file; pass a text file, one prompt per line"])


@checked(options="trainctl.data.prepare:prepare", passed=("inputs", "out", "records", "input_names"))
def prepare_data(inputs: Sequence[str | Path], out_dir: str | Path, *,
                 progress: Callable[[int, int | None], None] | None = None, data_format: str = "text",
                 messages_field: str = "messages", prompt_field: str = "prompt", completion_field: str = "completion",
                 max_doc_tokens: int | None = None, overlong: str = "refuse", hf: str | None = None,
                 split: str = "train", hf_config: str | None = None, **options):
    """Tokenize text into a token dataset (data.datasets=[DIR]); its metadata. `options`: data.prepare.prepare's
    (tokenizer, train_tokenizer, vocab_size, eos_token, bos, text_field, val_fraction, shard_tokens, workers,
    chat_template). hf: a Hugging Face dataset (a save_to_disk folder, a data file, a Hub name) read in place of
    `inputs`, its `split` and configuration `hf_config` (data/hf_source.py)."""
    from trainctl.data.chat import RecordOptions
    from trainctl.data.prepare import DatasetError
    from trainctl.data.prepare import prepare as tokenize

    records = RecordOptions(data_format, messages_field, prompt_field, completion_field, None, max_doc_tokens,
                            overlong)
    try:
        if hf is None:
            _hf_options_unused(split, hf_config)
            return tokenize([str(i) for i in inputs], out_dir, progress=progress, records=records, **options)
        if inputs:
            raise DatasetError(f"--hf {hf} and the inputs {' '.join(map(str, inputs))}: choose one")
        from trainctl.data import hf_source

        fields = hf_source.fields_of(data_format, options.get("text_field", "text"), messages_field, prompt_field,
                                     completion_field)
        optional = (prompt_field,) if data_format == "preference" else ()  # TRL's implicit-prompt layout
        with hf_source.exported(hf, split, hf_config, fields, optional) as rows:
            return tokenize([str(rows)], out_dir, progress=progress, records=records, input_names=[rows.name],
                            **options)
    except DatasetError as exc:
        raise UserError([str(exc)]) from None


def _hf_options_unused(split: str, hf_config: str | None) -> None:
    from trainctl.data.prepare import DatasetError

    if split != "train" or hf_config is not None:
        raise DatasetError(f"{'--split' if split != 'train' else '--hf-config'}: only with --hf NAME_OR_PATH "
                           "(a Hugging Face dataset)")
