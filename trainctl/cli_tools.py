"""The commands that hand a run's checkpoint to a torch child (export, generate, eval) and `data prepare`: they
parse, call `trainctl.api` and say the result. `register` adds them to the app trainctl/cli.py builds (this module
never imports cli)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from trainctl import api

out = Console(emoji=False)
err = Console(stderr=True, emoji=False)

RUN = typer.Argument(..., help="A run directory, or a run name under --runs-dir.", show_default=False)
RUNS_DIR = typer.Option(None, "--runs-dir", show_default=False, callback=lambda v: v or api.env_runs_dir(),
                        help="Where the runs are (the config's runs_dir; default: $TRAINCTL_RUNS_DIR, else runs).")
CHECKPOINT = typer.Option(None, "--checkpoint", help="Checkpoint directory or name under RUN/checkpoints "
                          "(default: the newest that verifies).", show_default=False)
DEVICE = typer.Option(None, "--device", help="cpu or cuda (default: the GPU if there is one).", show_default=False)


def export(
    run: str = RUN,
    checkpoint: str = typer.Option(
        None, "--checkpoint", help="Checkpoint directory or name under RUN/checkpoints; it must verify "
        "(default: the newest that verifies).", show_default=False),
    out_dir: str = typer.Option(
        None, "--out", help="Output folder (default: RUN/export/step-NNNNNNNN).", show_default=False),
    max_shard_size: str = typer.Option(
        None, "--max-shard-size", help="Bytes per file before sharding (e.g. 5000000000, 5GB).", show_default=False),
    dtype: str = typer.Option(
        None, "--dtype", help="Cast the weights: fp32, bf16 or fp16 (default: as saved).", show_default=False),
    verify: bool = typer.Option(
        False, "--verify", help="Load the export with transformers and compare every tensor and the logits with "
        "trainctl's model before calling it done (exit 1 and nothing written if they differ)."),
    merged: bool = typer.Option(False, "--merged", help="A LoRA run: full weights with the adapters folded in."),
    adapter: bool = typer.Option(
        False, "--adapter", help="A LoRA run: a PEFT adapter folder (adapter_config.json, adapter_model.safetensors)."),
    runs_dir: Path = RUNS_DIR,
) -> None:
    """Write a verified checkpoint's model as safetensors.  Example: trainctl export tiny_cpu-20250101-120000"""
    raise typer.Exit(api.export(run, checkpoint=checkpoint, out_dir=out_dir, max_shard_size=max_shard_size,
                                dtype=dtype, verify=verify, merged=merged, adapter=adapter, runs_dir=runs_dir))


def generate(
    run: str = RUN,
    prompt: str = typer.Option(None, "--prompt", help="The text to continue.", show_default=False),
    prompts: str = typer.Option(None, "--prompts", help="A text file, one prompt per line (prints JSON lines).",
                                show_default=False),
    prompt_ids: str = typer.Option(None, "--prompt-ids", help="Token ids instead of text (e.g. 1,2,3): for runs "
                                   "without a tokenizer (synthetic data).", show_default=False),
    checkpoint: str = CHECKPOINT,
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", help="Most tokens to add to each prompt."),
    temperature: float = typer.Option(0.0, "--temperature", help="0: greedy; above: sample."),
    top_p: float = typer.Option(1.0, "--top-p", help="Sample from the smallest set of tokens this likely."),
    seed: int = typer.Option(0, "--seed", help="Seeds the sampling: the same seed gives the same text."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt as a user message in the run's chat template."),
    device: str = DEVICE,
    runs_dir: Path = RUNS_DIR,
) -> None:
    """Continue a prompt with a run's checkpoint, on one device.  Example: trainctl generate RUN --prompt 'def '"""
    raise typer.Exit(api.generate(run, prompt=prompt, prompts=prompts, prompt_ids=prompt_ids, checkpoint=checkpoint,
                                  max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                  chat=chat, device=device, runs_dir=runs_dir))


def eval_command(
    run: str = RUN,
    data: str = typer.Option(..., "--data", help="A prepared dataset (trainctl data prepare) with a val split.",
                             show_default=False),
    checkpoint: str = CHECKPOINT,
    batches: int = typer.Option(None, "--batches", help="Val batches of the run's micro_batch x seq_len (default: "
                                "train.eval_batches x the run's data-parallel ranks).", show_default=False),
    as_json: bool = typer.Option(False, "--json", help="Print JSON (for scripts)."),
    device: str = DEVICE,
    runs_dir: Path = RUNS_DIR,
) -> None:
    """Loss and perplexity of a checkpoint over a dataset's val split.  Example: trainctl eval RUN --data tok"""
    raise typer.Exit(api.evaluate(run, data, checkpoint=checkpoint, batches=batches, as_json=as_json, device=device,
                                  runs_dir=runs_dir))


def data_prepare(
    inputs: list[str] = typer.Argument(..., help="Text files, folders or glob patterns (.txt .md .jsonl .parquet).",
                                       show_default=False),
    out_dir: str = typer.Option(..., "--out", help="The dataset folder to create.", show_default=False),
    tokenizer: str = typer.Option("bytes", "--tokenizer",
                                  help="bytes, or a Hugging Face tokenizer.json (or its model folder)."),
    train_tokenizer: bool = typer.Option(False, "--train-tokenizer", help="Train a byte-level BPE on the inputs."),
    vocab_size: int = typer.Option(None, "--vocab-size", help="With --train-tokenizer.", show_default=False),
    eos_token: str = typer.Option(None, "--eos-token", help="The end-of-document token (default: found).",
                                  show_default=False),
    text_field: str = typer.Option("text", "--text-field", help="The text field of .jsonl / .parquet records."),
    val_fraction: float = typer.Option(0.01, "--val-fraction", help="Share of text held out for eval."),
    shard_tokens: int = typer.Option(1 << 28, "--shard-tokens", help="Tokens per shard file."),
    workers: int = typer.Option(None, "--workers", help="Processes (default: one per core).", show_default=False),
    data_format: str = typer.Option("text", "--format", help="text, chat (a messages list per record) or "
                                    "instruction (prompt and completion): chat and instruction keep a loss mask."),
    messages_field: str = typer.Option("messages", "--messages-field", help="--format chat: the records' field."),
    prompt_field: str = typer.Option("prompt", "--prompt-field", help="--format instruction: the prompt field."),
    completion_field: str = typer.Option("completion", "--completion-field",
                                         help="--format instruction: the completion field (what the loss counts)."),
    chat_template: str = typer.Option(None, "--chat-template", show_default=False,
                                      help="chatml, llama3 or a .jinja file (default: the tokenizer's own)."),
    max_doc_tokens: int = typer.Option(None, "--max-doc-tokens", show_default=False,
                                       help="Longest chat / instruction document (e.g. train.seq_len + 1)."),
    overlong: str = typer.Option("refuse", "--overlong", help="A longer document: refuse, or truncate it."),
) -> None:
    """Tokenize text into a token dataset (data.datasets=[DIR]).  Example: trainctl data prepare docs/ --out tok"""
    from trainctl.render import progress_bar

    try:
        with progress_bar(err, "tokenizing") as progress:
            meta = api.prepare_data(
                inputs, out_dir, progress=progress, data_format=data_format, messages_field=messages_field,
                prompt_field=prompt_field, completion_field=completion_field, max_doc_tokens=max_doc_tokens,
                overlong=overlong, tokenizer=tokenizer, train_tokenizer=train_tokenizer, vocab_size=vocab_size,
                eos_token=eos_token, text_field=text_field, val_fraction=val_fraction, shard_tokens=shard_tokens,
                workers=workers, chat_template=chat_template)
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
    out.print(f"train on it with: data=memmap data.datasets=[{meta.root}]{note}", markup=False, highlight=False,
              soft_wrap=True)


def tune(
    overrides: list[str] = typer.Argument(None, help="Hydra overrides naming the run to tune, e.g. recipe=tiny_cpu.",
                                          show_default=False),
    top: int = typer.Option(4, "--top", help="How many of the fastest predicted layouts to probe."),
    probe_steps: int = typer.Option(20, "--probe-steps", help="Optimizer steps of each probe."),
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
                              probe_timeout_s=probe_timeout, name=name, on_probe=said)
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
