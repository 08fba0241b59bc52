"""The commands that hand a run's checkpoint to a torch child (export, generate, eval) and `data prepare`: they
parse, call `trainctl.api` and say the result. Export, generate and eval take the options core/tool_options.py
declares, each once: their Typer options are derived from those fields here. `register` adds them to the app
trainctl/cli.py builds (this module never imports cli)."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import MISSING, asdict
from functools import partial
from pathlib import Path

import typer
from rich.console import Console

from trainctl import api
from trainctl.core.tool_options import Declared, EvalOptions, ExportOptions, GenerateOptions, declared

out = Console(emoji=False)
err = Console(stderr=True, emoji=False)

RUN = typer.Argument(..., help="A run directory, or a run name under --runs-dir.", show_default=False)
RUNS_DIR = typer.Option(None, "--runs-dir", show_default=False, callback=lambda v: v or api.env_runs_dir(),
                        help="Where the runs are (the config's runs_dir; default: $TRAINCTL_RUNS_DIR, else runs).")
AS_JSON = typer.Option(False, "--json", help="Print JSON (for scripts).")


def _typer_option(option: Declared):
    """The Typer option of one declared tool option (core/tool_options.py says its flag, help and default)."""
    if option.default is MISSING:
        return typer.Option(..., option.flag, help=option.help, show_default=False)
    return typer.Option(option.default, option.flag, help=option.help, show_default=option.default is not None)


def tool_command(name: str, options: type, call: Callable, doc: str,
                 failed: Callable[[object], bool] | None = None) -> Callable:
    """A command `trainctl NAME RUN [its declared options] [--json] [--runs-dir]`: it calls `call(run, options,
    runs_dir=...)` and prints the value's text, or its JSON; exit 1 after printing when `failed(value)` says so
    (part of the work failed; the child said why on stderr)."""
    param = partial(inspect.Parameter, kind=inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = [param("run", default=RUN, annotation=str)]
    params += [param(o.name, default=_typer_option(o), annotation=o.type) for o in declared(options)]
    params += [param("as_json", default=AS_JSON, annotation=bool), param("runs_dir", default=RUNS_DIR, annotation=Path)]

    def command(run: str, as_json: bool, runs_dir: Path, **values) -> None:
        from trainctl.render import print_json

        value = call(run, options(**values), runs_dir=runs_dir)
        if as_json:
            print_json(asdict(value))
        else:
            sys.stdout.write(value.text() + "\n")  # as the tool wrote it: no markup, wrapping or tab expansion
        if failed is not None and failed(value):
            raise typer.Exit(1)

    command.__signature__ = inspect.Signature(params)  # what Typer reads: the declared options, in their order
    command.__annotations__ = {p.name: p.annotation for p in params}
    command.__name__, command.__doc__ = name, doc
    return command


export = tool_command("export", ExportOptions, api.export, "Write a verified checkpoint's model as safetensors.  "
                      "Example: trainctl export tiny_cpu-20250101-120000")
generate = tool_command("generate", GenerateOptions, api.generate, "Continue a prompt with a run's checkpoint, on "
                        "one device.  Example: trainctl generate RUN --prompt 'def '",
                        failed=lambda generated: bool(generated.failed))
eval_command = tool_command("eval", EvalOptions, api.evaluate, "Loss and perplexity of a checkpoint over a "
                            "dataset's split or a text file, or lm-evaluation-harness tasks.  Example: trainctl eval "
                            "RUN --data tok --all")


def data_prepare(
    inputs: list[str] = typer.Argument(None, help="Text files, folders or glob patterns (.txt .md .jsonl .parquet).",
                                       show_default=False),
    out_dir: str = typer.Option(..., "--out", help="The dataset folder to create.", show_default=False),
    tokenizer: str = typer.Option("bytes", "--tokenizer",
                                  help="bytes, a Hugging Face tokenizer.json, its model folder, or a Hub name "
                                  "(org/name, through the Hugging Face cache)."),
    train_tokenizer: bool = typer.Option(False, "--train-tokenizer", help="Train a byte-level BPE on the inputs."),
    vocab_size: int = typer.Option(None, "--vocab-size", help="With --train-tokenizer.", show_default=False),
    eos_token: str = typer.Option(None, "--eos-token", show_default=False,
                                  help="The end-of-document token (default: tokenizer_config.json's, else found)."),
    bos: bool = typer.Option(None, "--bos/--no-bos", show_default=False,
                             help="Start each text document with the beginning-of-text token (default: as the "
                             "tokenizer_config.json says: add_bos_token, else whether it names a bos_token)."),
    text_field: str = typer.Option("text", "--text-field", help="The text field of .jsonl / .parquet records."),
    val_fraction: float = typer.Option(0.01, "--val-fraction", help="Share of text held out for eval (1: an "
                                       "eval-only set)."),
    shard_tokens: int = typer.Option(1 << 28, "--shard-tokens", help="Tokens per shard file."),
    workers: int = typer.Option(None, "--workers", help="Processes (default: one per core).", show_default=False),
    data_format: str = typer.Option("text", "--format", help="text, chat (a messages list per record), "
                                    "instruction (prompt and completion) or preference (prompt, chosen, rejected): "
                                    "all but text keep a loss mask."),
    messages_field: str = typer.Option("messages", "--messages-field", help="--format chat: the records' field."),
    prompt_field: str = typer.Option("prompt", "--prompt-field", help="--format instruction or preference: "
                                      "the prompt field."),
    completion_field: str = typer.Option("completion", "--completion-field",
                                         help="--format instruction: the completion field (what the loss counts)."),
    chat_template: str = typer.Option(None, "--chat-template", show_default=False,
                                      help="chatml, llama3 or a .jinja file (default: the tokenizer's own)."),
    max_doc_tokens: int = typer.Option(None, "--max-doc-tokens", show_default=False,
                                       help="Longest chat / instruction document (e.g. train.seq_len + 1)."),
    overlong: str = typer.Option("refuse", "--overlong", help="A longer document: refuse, or truncate it."),
    hf: str = typer.Option(None, "--hf", show_default=False,
                           help="A Hugging Face dataset instead of INPUTS: a save_to_disk folder, a .parquet .arrow "
                           ".json .jsonl .csv file, or a Hub name (through the datasets cache)."),
    split: str = typer.Option("train", "--split", help="--hf: the dataset's split to read."),
    hf_config: str = typer.Option(None, "--hf-config", show_default=False,
                                  help="--hf: the dataset's configuration (subset) name."),
) -> None:
    """Tokenize text into a token dataset (data.datasets=[DIR]).  Example: trainctl data prepare docs/ --out tok"""
    from trainctl.render import progress_bar

    if not inputs and hf is None:
        err.print("data prepare: name the text (files, folders or glob patterns) or a Hugging Face dataset "
                  "(--hf NAME_OR_PATH)", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(2)
    try:
        with progress_bar(err, "tokenizing") as progress:
            meta = api.prepare_data(
                inputs or [], out_dir, progress=progress, data_format=data_format, messages_field=messages_field,
                prompt_field=prompt_field, completion_field=completion_field, max_doc_tokens=max_doc_tokens,
                overlong=overlong, tokenizer=tokenizer, train_tokenizer=train_tokenizer, vocab_size=vocab_size,
                eos_token=eos_token, bos=bos, text_field=text_field, val_fraction=val_fraction,
                shard_tokens=shard_tokens,
                workers=workers, chat_template=chat_template, hf=hf, split=split, hf_config=hf_config)
    except KeyboardInterrupt:
        err.print(f"interrupted: run the same command again to continue where it stopped ({out_dir})",
                  markup=False, highlight=False)
        raise typer.Exit(130) from None
    train, val = meta.splits["train"], meta.splits["val"]
    counted = f", {train.loss_tokens:,} of them in the loss" if train.loss_tokens is not None else ""
    out.print(f"{meta.root}: {train.tokens:,} train tokens{counted} ({train.documents:,} documents, "
              f"{len(train.shards)} shards), {val.tokens:,} val tokens; {meta.tokenizer.kind} tokenizer, vocabulary "
              f"{meta.tokenizer.vocab_size:,}, {meta.token_dtype}", markup=False, highlight=False, soft_wrap=True)
    # Evaluation reads the val split: plan and launch refuse an empty one unless eval is off.
    note = "" if val.tokens else "\nno val split: train with train.eval_every=0, or prepare with --val-fraction 0.01"
    use = f"train on it with: data=memmap data.datasets=[{meta.root}]{note}" if train.tokens else (
        f"an eval-only set: trainctl eval RUN --data {meta.root} --all")
    out.print(use, markup=False, highlight=False, soft_wrap=True)


def tune(
    overrides: list[str] = typer.Argument(None, help="Hydra overrides naming the run to tune, e.g. recipe=tiny_cpu.",
                                          show_default=False),
    top: int = typer.Option(4, "--top", help="How many of the fastest predicted layouts to probe."),
    probe_steps: int = typer.Option(20, "--probe-steps", help="Optimizer steps of each probe."),
    repeats: int = typer.Option(2, "--repeats", help="Runs of each probe (local): the table shows their spread."),
    probe_timeout: float = typer.Option(600.0, "--probe-timeout", help="Seconds before a probe counts as hung and "
                                        "is cancelled."),
    name: str = typer.Option("", "--name", help="The tune folder's name under RUNS_DIR/tune (default: recipe and a "
                             "timestamp)."),
    as_json: bool = typer.Option(False, "--json", help="Print tune.json (for scripts)."),
    collect: str = typer.Option(None, "--collect", help="Slurm: read the probes of tune NAME once they ended, then "
                                "write its table and pinned recipe.", show_default=False),
    runs_dir: Path = RUNS_DIR,
    config_dirs: list[Path] = typer.Option(None, "--config-dir", help="A folder of your own options (repeatable).",
                                           show_default=False),
) -> None:
    """Probe the fastest layouts the plan says fit, rank them by measured tokens/s, pin the winner as a recipe.
    Example: trainctl tune recipe=tiny_cpu --top 4 --probe-steps 20"""
    from trainctl.api.tuning import TuneInterrupted
    from trainctl.api.tuning import tune as run_tune
    from trainctl.render import print_json, tune_table

    def filled(result) -> None:
        if result.filled:
            (err if as_json else out).print(f"tune filled in for this cluster: {' '.join(result.filled)}",
                                            markup=False, highlight=False, soft_wrap=True)

    def said(probe, i: int, total: int) -> None:
        say = err if as_json else out
        say.print(f"probe {i + 1}/{total}: {probe.label} {' '.join(probe.overrides)}", markup=False,
                  highlight=False, soft_wrap=True)

    if collect is not None:
        from trainctl.api.tuning_queued import collect as collected

        result = collected(collect, runs_dir, api.search(config_dirs))
    else:
        try:
            result = run_tune(overrides, api.search(config_dirs), top=top, probe_steps=probe_steps,
                              probe_timeout_s=probe_timeout, name=name, repeats=repeats, on_probe=said,
                              on_start=filled)
        except TuneInterrupted as stopped:
            err.print(f"trainctl: tune interrupted; the running probe was stopped, nothing pinned; the finished "
                      f"probes are in {stopped.result.folder / 'tune.json'}", markup=False, highlight=False,
                      soft_wrap=True)
            raise typer.Exit(130) from None
    data = result.to_dict()
    if result.job_id and not as_json and not collect:  # Slurm: submitted, nothing measured yet
        out.print(result.message, markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(0)
    if as_json:
        print_json(data)
    else:
        out.print(tune_table(data))
        if result.noise:
            out.print(result.noise, markup=False, highlight=False, soft_wrap=True)
        last = f"pinned: {result.recipe_file}\nlaunch it with: {result.launch_command}" if result.recipe_file else (
            "every probe failed: nothing pinned; see each probe's logs (trainctl logs RUN --runs-dir ...)")
        out.print(f"wrote {result.folder / 'tune.json'}\n{last}", markup=False, highlight=False, soft_wrap=True)
    submitted = bool(result.job_id) and collect is None  # Slurm: the table comes with --collect
    raise typer.Exit(0 if result.recipe_file or submitted else 1)


def register(app: typer.Typer, data_app: typer.Typer) -> None:
    """Add these commands to trainctl's app, in `trainctl --help`'s order after resume."""
    app.command()(tune)
    app.command()(export)
    app.command()(generate)
    app.command("eval")(eval_command)
    data_app.command("prepare")(data_prepare)
