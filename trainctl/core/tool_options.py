"""The options of `trainctl export`, `generate` and `eval`, each declared once, and what those tools return.

Each option is one dataclass field: its name, type, default, flag, help and allowed values. The CLI derives its
Typer options from these fields (cli_tools.py), the api takes the dataclass, checks it (`problems`) before any
child starts, and hands it to the torch child as JSON on its command line (`child_argv` / `read_child_argv`); the
child writes its result (a dataclass below) as JSON to the path it is given, and the api reads it back. Pure
Python on purpose: both sides of the wall import it.
"""

from __future__ import annotations

import json
import math
import re
import sys
import typing
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from trainctl.core import rundir
from trainctl.core.errors import UserError

EXPORT_DTYPES = ("fp32", "bf16", "fp16")  # the exporter's torch dtypes are keyed by these names
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # Hugging Face's save_pretrained default ("5GB")
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
DEVICE_HELP = "cpu or cuda (default: the GPU if there is one)."
CHECKPOINT_HELP = "Checkpoint directory or name under RUN/checkpoints (default: the newest that verifies)."


def option(flag: str, help: str, default: object = MISSING, *, choices: tuple[str, ...] = ()):  # noqa: A002
    """A field that is also a command-line option: the one place its flag, help and allowed values are said."""
    return field(default=default, metadata={"flag": flag, "help": help, "choices": choices})


@dataclass(frozen=True)
class Declared:
    """One option as the CLI shows it (read from a field by `declared`)."""

    name: str
    flag: str
    help: str
    type: object
    default: object  # MISSING: required
    choices: tuple[str, ...]


def declared(cls: type) -> list[Declared]:
    """The options `cls` declares, in declaration order, with their real types (not the annotations' strings)."""
    hints = typing.get_type_hints(cls)
    return [Declared(f.name, f.metadata["flag"], f.metadata["help"], hints[f.name], f.default, f.metadata["choices"])
            for f in fields(cls)]


def parse_size(text: str) -> int | None:
    """Bytes from "5000000", "500MB" or "2GiB" (decimal KB/MB/GB as Hugging Face counts them); None: not a size."""
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if unit not in SIZE_UNITS or int(match.group(1)) <= 0:
        return None
    return int(match.group(1)) * SIZE_UNITS[unit]


@dataclass(frozen=True)
class ExportOptions:
    checkpoint: str | None = option("--checkpoint", "Checkpoint directory or name under RUN/checkpoints; it must "
                                    "verify (default: the newest that verifies).", None)
    out: str | None = option("--out", "Output folder (default: RUN/export/step-NNNNNNNN).", None)
    max_shard_size: str | None = option("--max-shard-size", "Bytes per file before sharding (e.g. 5000000000, "
                                        "5GB).", None)
    dtype: str | None = option("--dtype", "Cast the weights: fp32, bf16 or fp16 (default: as saved).", None,
                               choices=EXPORT_DTYPES)
    verify: bool = option("--verify", "Load the export with transformers and compare every tensor and the logits "
                          "with trainctl's model before calling it done (exit 1 and nothing written if they "
                          "differ).", False)
    merged: bool = option("--merged", "A LoRA run: full weights with the adapters folded in.", False)
    adapter: bool = option("--adapter", "A LoRA run: a PEFT adapter folder (adapter_config.json, "
                           "adapter_model.safetensors).", False)

    def problems(self) -> list[str]:
        """What is wrong with these values on their own, one line each (the checkpoint is the child's to read)."""
        found = []
        if self.out is not None and not self.out.strip():
            found.append("--out '': empty; name a new folder, e.g. --out exports/mymodel")
        if self.max_shard_size is not None and parse_size(self.max_shard_size) is None:
            found.append(f"--max-shard-size={self.max_shard_size}: expected a positive number of bytes, e.g. "
                         "5000000000 or 5GB")
        if self.dtype is not None and self.dtype not in EXPORT_DTYPES:
            found.append(f"--dtype {self.dtype}: not an export dtype; use one of {', '.join(EXPORT_DTYPES)} "
                         "(quantized formats are not written)")
        if self.merged and self.adapter:
            found.append("--merged and --adapter: pick one (full weights, or a PEFT adapter folder)")
        return found

    @property
    def shard_bytes(self) -> int:
        return DEFAULT_MAX_SHARD_SIZE if self.max_shard_size is None else parse_size(self.max_shard_size)

    @property
    def lora_mode(self) -> str | None:
        return "merged" if self.merged else "adapter" if self.adapter else None


@dataclass(frozen=True)
class GenerateOptions:
    prompt: str | None = option("--prompt", "The text to continue.", None)
    prompts: str | None = option("--prompts", "A text file, one prompt per line (prints JSON lines; exit 1 when a "
                                 "line was not answered, once every line is printed).", None)
    prompt_ids: str | None = option("--prompt-ids", "Token ids instead of text (e.g. 1,2,3): for runs without a "
                                    "tokenizer (synthetic data).", None)
    checkpoint: str | None = option("--checkpoint", CHECKPOINT_HELP, None)
    max_new_tokens: int = option("--max-new-tokens", "Most tokens to add to each prompt.", 128)
    temperature: float = option("--temperature", "0: greedy; above: sample.", 0.0)
    top_p: float = option("--top-p", "Sample from the smallest set of tokens this likely.", 1.0)
    seed: int = option("--seed", "Seeds the sampling: the same seed gives the same text.", 0)
    chat: bool = option("--chat", "Wrap the prompt as a user message in the run's chat template.", False)
    device: str | None = option("--device", DEVICE_HELP, None)

    def problems(self) -> list[str]:
        given = [flag for flag, value in (("--prompt", self.prompt), ("--prompts", self.prompts),
                                          ("--prompt-ids", self.prompt_ids)) if value is not None]
        found = []
        if len(given) != 1:
            found.append(f"{' and '.join(given) or 'no prompt'}: give exactly one of --prompt TEXT, --prompts FILE "
                         "or --prompt-ids 1,2,3")
        if self.prompt is not None and not self.prompt.strip():
            found.append("--prompt '': empty; give some text, or --prompts FILE")
        if self.chat and self.prompt_ids is not None:
            found.append("--chat with --prompt-ids: ids are already what the model reads; leave --chat out")
        if self.max_new_tokens < 1:
            found.append(f"--max-new-tokens {self.max_new_tokens}: must be at least 1")
        if not 0 <= self.temperature < math.inf:  # inf flattens every logit to one: uniform random tokens
            found.append(f"--temperature {self.temperature}: must be a finite number >= 0 (0: greedy)")
        if not 0 < self.top_p <= 1:
            found.append(f"--top-p {self.top_p}: must be in (0, 1]")
        return found


EVAL_SPLITS = ("val", "train")


@dataclass(frozen=True)
class EvalOptions:
    data: str | None = option("--data", "A prepared dataset (trainctl data prepare), or a text, .jsonl or .parquet "
                              "file: tokenized with the run's tokenizer and read in one full pass.", None)
    split: str = option("--split", "The prepared dataset's split: val or train.", "val", choices=EVAL_SPLITS)
    full: bool = option("--all", "One full pass over the split: windows that do not overlap, every token after "
                        "the first scored once.", False)
    checkpoint: str | None = option("--checkpoint", CHECKPOINT_HELP, None)
    batches: int | None = option("--batches", "Batches of the run's micro_batch x seq_len, drawn as the worker's "
                                 "val loss draws them (default: train.eval_batches x the run's data-parallel ranks; "
                                 "more than the split holds: one full pass).", None)
    tasks: str | None = option("--tasks", "lm-evaluation-harness tasks, comma-separated (pip install "
                               "'trainctl[eval]'); the results go to RUN/" + rundir.LM_EVAL + ".", None)
    include_path: str | None = option("--include-path", "A folder of your own lm-evaluation-harness task YAMLs "
                                      "(with --tasks).", None)
    limit: int | None = option("--limit", "With --tasks: at most this many documents per task.", None)
    device: str | None = option("--device", DEVICE_HELP, None)

    def problems(self) -> list[str]:
        found = []
        if self.data is None and self.tasks is None:
            found.append("nothing to evaluate: give --data DATASET_OR_FILE (loss and perplexity) or --tasks NAMES "
                         "(lm-evaluation-harness)")
        if self.data is not None and not self.data.strip():
            found.append("--data '': empty; name a prepared dataset or a text file")
        if self.split not in EVAL_SPLITS:
            found.append(f"--split {self.split}: use one of {', '.join(EVAL_SPLITS)}")
        if self.batches is not None and self.batches < 1:
            found.append(f"--batches {self.batches}: must be at least 1")
        if self.full and self.batches is not None:
            found.append(f"--all and --batches {self.batches}: pick one (--all reads the whole split once)")
        if self.tasks is not None and not [t for t in self.tasks.split(",") if t.strip()]:
            found.append(f"--tasks {self.tasks!r}: name at least one task, e.g. --tasks hellaswag")
        if self.tasks is None and (self.include_path is not None or self.limit is not None):
            found.append("--include-path and --limit go with --tasks; add --tasks NAMES or leave them out")
        if self.limit is not None and self.limit < 1:
            found.append(f"--limit {self.limit}: must be at least 1")
        return found


@dataclass(frozen=True)
class ExportReport:
    """What `trainctl export` wrote: the folder, its files, the checkpoint step (None: a PEFT adapter folder) and,
    with --verify, what the check against transformers measured."""

    out: str
    files: list[str]
    dtype: str | None = None  # None: as saved
    step: int | None = None
    verified: dict | None = None  # architecture, worst_tensor, logits_diff, tokens
    verified_line: str | None = None
    note: str | None = None  # what the export holds beyond its files (QLoRA: a dequantized base)

    def text(self) -> str:
        """What `trainctl export` prints."""
        what = f"step {self.step} " if self.step is not None else "the adapters "
        line = f"exported {what}to {self.out}: {', '.join(self.files)}"
        return "\n".join(part for part in (line, self.note, self.verified_line) if part)


@dataclass(frozen=True)
class Completion:
    prompt: str
    completion: str
    ids: list[int]
    error: str | None = None  # --prompts FILE: why this line has no completion (the other lines still have theirs)


@dataclass(frozen=True)
class Generated:
    """`trainctl generate`'s completions, one per prompt, in the prompts' order."""

    completions: list[Completion]
    from_file: bool = False  # --prompts FILE: rendered as JSON lines

    @classmethod
    def from_dict(cls, data: dict) -> Generated:
        return cls([Completion(**c) for c in data["completions"]], data.get("from_file", False))

    @property
    def failed(self) -> list[Completion]:
        """The prompts of a file that got no completion (each says why in its `error`)."""
        return [c for c in self.completions if c.error is not None]

    def text(self) -> str:
        """What `trainctl generate` prints: the completion, or one JSON object per line for a file of prompts."""
        if not self.from_file:
            return "\n".join(c.completion for c in self.completions)
        return "\n".join(json.dumps({k: v for k, v in asdict(c).items() if k != "error" or v is not None},
                                     ensure_ascii=False) for c in self.completions)


@dataclass(frozen=True)
class EvalResult:
    """Loss and perplexity of a checkpoint over a dataset's split and what they were computed over, and/or
    lm-evaluation-harness's metrics per task."""

    loss: float | None
    perplexity: float | None
    tokens: int  # targets that counted in the loss
    batches: int
    seq_len: int
    micro_batch: int
    step: int | None
    checkpoint: str
    data: str | None
    split: str = "val"
    positions: int | None = None  # distinct token positions of the split those targets cover
    split_tokens: int | None = None
    full_pass: bool = False
    note: str | None = None  # e.g. --batches beyond the split: one full pass instead
    tasks: dict | None = None  # lm-evaluation-harness: task -> {metric: value}
    tasks_file: str | None = None
    pairs: dict | None = None  # a preference run on preference pairs: {objective, pairs, loss, PAIR_METRICS...}

    def text(self) -> str:
        """What `trainctl eval` prints."""
        lines = [self.note] if self.note else []
        if self.loss is not None:
            lines.append(f"step {self.step}: {self.split} loss {self.loss:.4f}, perplexity {self.perplexity:.3f} "
                         f"over {self.tokens:,} tokens ({self._coverage()}{self.batches} batches of "
                         f"{self.micro_batch} x {self.seq_len}) of {self.data}")
        if self.pairs is not None:
            p = self.pairs
            lines.append(f"step {self.step}: {self.split} pairs {p['pairs']:,} ({self.batches} batches of "
                         f"{self.micro_batch} pairs x {self.seq_len}) of {self.data}: {p['objective']} loss "
                         f"{p['loss']:.4f}, accuracy {p['reward_accuracy']:.1%}, margin {p['reward_margin']:.4g} "
                         f"(chosen {p['reward_chosen']:.4g}, rejected {p['reward_rejected']:.4g})")
        for task, metrics in (self.tasks or {}).items():
            shown = ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
            lines.append(f"step {self.step}: {task}: {shown}")
        if self.tasks_file:
            lines.append(f"wrote {self.tasks_file}")
        return "\n".join(lines)

    def _coverage(self) -> str:
        if self.split_tokens is None:
            return ""
        if self.full_pass:
            return f"one full pass over the {self.split} split's {self.split_tokens:,} tokens; "
        return f"windows covering {self.positions:,} distinct of the split's {self.split_tokens:,} tokens; "


def child_argv(module: str, run_dir: Path, options: object, result: Path) -> list[str]:
    """`python -m MODULE RUN_DIR OPTIONS_JSON RESULT_JSON`, through core/lean_process.py (its imports without the
    garbage collector, its end without the teardown of torch's modules): how the api starts a tool's torch child."""
    return [sys.executable, "-m", "trainctl.core.lean_process", module, str(run_dir), json.dumps(asdict(options)),
            str(result)]


def read_child_argv(cls: type, argv: list[str]) -> tuple[Path, object, Path | None]:
    """(run directory, options, result path or None) from `child_argv`'s arguments (after the module)."""
    run_dir, options, *result = argv
    return Path(run_dir), cls(**json.loads(options)), Path(result[0]) if result else None


class ToolFailed(Exception):
    """A tool could not do its work through no mistake of the user's (exit 1; one line): e.g. `export --verify`
    found the export differs from the checkpoint."""


def serve(cls: type, argv: list[str], run: Callable[[Path, object], object]) -> int:
    """A tool child's whole life: read its arguments, run, write the value or the one-line error to the result
    file (without one, print the value's text or the error); the exit code: 0, 2 for a user error, 1 for a
    ToolFailed."""
    run_dir, options, result = read_child_argv(cls, argv)
    try:
        value, code, error = run(run_dir, options), 0, None
    except UserError as exc:
        value, code, error = None, 2, "; ".join(exc.problems)
    except ToolFailed as exc:
        value, code, error = None, 1, str(exc)
    if result is not None:
        body = {"code": code, "error": error, "value": asdict(value) if value is not None else None}
        result.write_text(json.dumps(body, ensure_ascii=False))
    elif error is not None:
        print(f"error: {error}", file=sys.stderr)
    else:
        print(value.text(), flush=True)
    return code
