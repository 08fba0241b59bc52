"""Loss and perplexity of a run's checkpoint over a prepared dataset's val split: `trainctl eval` runs this module.

    python -m trainctl.train.evaluate RUN_DIR OPTIONS_JSON [RESULT_JSON]

(the options: core/tool_options.EvalOptions as JSON; the result goes to RESULT_JSON, else to stdout.)

The worker's own reading code (train/loop/data.py's TokenBatches.eval_batches: the same fixed windows, the loss
masks of chat / instruction data honoured) and its loss (the model's summed token cross-entropy over the
targets that count, divided by their number). With the run's seq_len and micro_batch, and by default its
train.eval_batches times its data-parallel degree (the union of what every dp rank evaluated), the loss equals
the worker's val loss for the same checkpoint and split (fp32; a run trained under bf16 autocast differs by its
rounding). A dataset tokenized with another tokenizer than the run's is refused: its ids would mean other text.
"""

from __future__ import annotations

import math
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from trainctl.config.load import load_run_config
from trainctl.config.schema import DataConfig, RunConfig
from trainctl.core import checkpoints
from trainctl.core import rundir as layout
from trainctl.core.errors import UserError
from trainctl.core.tool_options import EvalOptions, EvalResult, serve
from trainctl.data import format as dataset
from trainctl.data.prepare import prepare
from trainctl.models.checkpoint_reader import read_model_config
from trainctl.models.generate import load_model, pick_device
from trainctl.models.loss_head import IGNORE_INDEX
from trainctl.models.run_tokens import run_tokens
from trainctl.train import evaluate_pairs
from trainctl.train.loop.data import TokenBatches
from trainctl.train.loop.loss import token_loss_sum
from trainctl.train.loop.sources import DataError


class EvalError(UserError):
    """A problem the user can fix; one line."""


def run_fingerprint(run_dir: Path) -> str | None:
    """The fingerprint (data/format.tokenizer_fingerprint) of the tokenizer the run trained with; None: unknown."""
    tokens = run_tokens(run_dir)
    if tokens.kind == "bytes":
        return dataset.BYTES_FINGERPRINT
    if tokens.kind == "hf":
        return dataset.tokenizer_fingerprint(tokens.file)
    return None


def check_dataset(run_dir: Path, data_dir: str, vocab_size: int) -> dataset.DatasetMeta:
    """The dataset's meta when it was tokenized as the run's data was; else refused in one line."""
    try:
        meta = dataset.read_meta(data_dir)
    except dataset.DatasetError as exc:
        raise EvalError([f"--data {exc}"]) from None
    ours = run_fingerprint(run_dir)
    if ours is None:
        raise EvalError([f"--data {data_dir}: {run_dir} trained without a tokenizer (synthetic data), so no dataset "
                         "is known to match it; evaluate a run that trained on prepared or stdlib data"])
    if meta.tokenizer.fingerprint != ours:
        raise EvalError([f"--data {data_dir}: tokenized with another tokenizer than the run's ({meta.tokenizer.kind}"
                         f" {meta.tokenizer.fingerprint or 'unknown'}, the run's {ours}); prepare it with the run's "
                         f"tokenizer (--tokenizer {run_tokenizer_arg(run_dir)}), or pass the text file itself"])
    if meta.tokenizer.vocab_size > vocab_size:
        raise EvalError([f"--data {data_dir}: ids up to {meta.tokenizer.vocab_size - 1}, above the model's "
                         f"vocab_size={vocab_size}; evaluate data of the run's tokenizer"])
    return meta


def run_tokenizer_arg(run_dir: Path) -> str:
    """What `data prepare --tokenizer` takes to tokenize as the run did: `bytes`, or the run's tokenizer.json."""
    tokens = run_tokens(run_dir)
    return "bytes" if tokens.kind == "bytes" else str(tokens.file)


@contextmanager
def dataset_of(run_dir: Path, data: str) -> Iterator[tuple[str, bool]]:
    """(a prepared dataset's folder, whether it was made here): a text, .jsonl or .parquet file is tokenized with the
    run's tokenizer into a temporary eval-only dataset (every document in its val split), removed afterwards."""
    path = Path(data).expanduser()
    if not path.exists():
        raise EvalError([f"--data {data}: no such file or folder; name a prepared dataset (trainctl data prepare "
                         "TEXT --out DIR) or a text, .jsonl or .parquet file"])
    if not path.is_file():
        yield data, False
        return
    if run_fingerprint(run_dir) is None:
        raise EvalError([f"--data {data}: {run_dir} trained without a tokenizer (synthetic data): its text cannot "
                         "be tokenized as the run's; evaluate a run that trained on prepared or stdlib data"])
    tokens = run_tokens(run_dir)
    eos = None
    if tokens.kind == "hf" and tokens.eos_ids:
        from tokenizers import Tokenizer

        eos = Tokenizer.from_file(tokens.file).id_to_token(tokens.eos_ids[0])
    with tempfile.TemporaryDirectory(prefix="trainctl-eval-") as folder:
        try:
            prepare([str(path)], Path(folder) / "data", tokenizer=run_tokenizer_arg(run_dir), eos_token=eos,
                    val_fraction=1.0, workers=1)
        except dataset.DatasetError as exc:
            raise EvalError([f"--data {exc}"]) from None
        yield str(Path(folder) / "data"), True


def dp_degree(run_dir: Path, cfg: RunConfig) -> int:
    """How many data-parallel ranks evaluated disjoint samples: plan.json's, else the config's positive sizes."""
    dims = layout.read_json(run_dir / layout.PLAN).get("dims") or {}
    if isinstance(dims.get("dp"), int) and dims["dp"] > 0:
        return dims["dp"]
    return max(1, cfg.sharding.dp_replicate) * max(1, cfg.sharding.dp_shard)


def split_batches(cfg: RunConfig, meta: dataset.DatasetMeta, split: str, vocab_size: int) -> TokenBatches:
    """The split's batches; one shorter than a window is read as one window of all of it (a full pass)."""
    train, data_dir, size = cfg.train, str(meta.root), meta.splits[split].tokens
    if size < 2:
        raise EvalError([f"--data {data_dir}: its {split} split has {size} tokens, nothing to score; evaluate "
                         f"another split (--split) or more text"])
    data = DataConfig(kind="memmap", datasets=[data_dir], vocab_size=vocab_size)
    try:
        return TokenBatches(data, split, min(train.seq_len, size - 1), train.micro_batch, train.micro_batch, 1, 0, 1,
                            seed=0)
    except DataError as exc:
        raise EvalError([f"--data {data_dir}: {exc}"]) from None


def chosen_windows(source: TokenBatches, batches: int, full: bool,
                   asked: str = "--batches") -> tuple[Iterable, int, int, str | None]:
    """(the micro-batches, how many, the distinct token positions their targets cover, a note): the run's own
    eval windows (drawn apart, as the worker's val loss reads them), or one full pass when asked for, or when
    the batches asked for hold more windows than the split has (a second pass would only re-read it)."""
    rows = source.full_pass_rows()
    if not full and batches * source.micro_batch < rows:
        try:
            return source.eval_batches(batches), batches, source.eval_positions(batches), None
        except DataError as exc:
            raise EvalError([f"--data {exc}"]) from None
    count = -(-rows // source.micro_batch)
    note = None if full else (f"{asked} {batches} holds more than the split's {rows} windows of "
                              f"{source.seq_len} tokens: one full pass ({count} batches) instead")
    return source.full_pass(), count, source.num_tokens - 1, note


@torch.no_grad()
def loss_totals(model: torch.nn.Module, device: torch.device, batches: Iterable) -> tuple[float, int]:
    """(summed token loss, counted targets) over the batches, as the worker's eval_totals sums them."""
    total, count = 0.0, 0
    for inputs, targets in batches:
        inputs, targets = inputs.to(device), targets.to(device)
        total += float(token_loss_sum(model, inputs, targets).double())
        count += int((targets != IGNORE_INDEX).sum())
    return total, count


def loss_over(run_dir: Path, cfg: RunConfig, options: EvalOptions, model: Callable) -> dict:
    """EvalResult's loss fields over --data: the run's eval windows, or one full pass."""
    vocab_size = read_model_config(run_dir).vocab_size
    with dataset_of(run_dir, options.data) as (data_dir, from_file):
        meta = check_dataset(run_dir, data_dir, vocab_size)
        if meta.content == "preference":
            return pairs_over(run_dir, cfg, options, model, data_dir, vocab_size)
        source = split_batches(cfg, meta, options.split, vocab_size)
        asked = options.batches or cfg.train.eval_batches * dp_degree(run_dir, cfg)
        windows, batches, positions, note = chosen_windows(
            source, asked, options.full or from_file, "--batches" if options.batches else "the default batches")
        try:
            total, count = loss_totals(*model(), windows)
        except DataError as exc:
            raise EvalError([f"--data {options.data}: {exc}"]) from None
    if count == 0:
        raise EvalError([f"--data {options.data}: no target of the {batches} {options.split} batches counts in the "
                         "loss (every token masked); evaluate more --batches, --all, or a dataset with answers in "
                         f"its {options.split} split"])
    loss, full = total / count, note is not None or options.full or from_file
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": count, "batches": batches,
            "data": str(Path(options.data).expanduser().resolve()), "split": options.split, "positions": positions,
            "seq_len": source.seq_len, "split_tokens": source.num_tokens, "full_pass": full, "note": note}


def pairs_over(run_dir: Path, cfg: RunConfig, options: EvalOptions, model: Callable, data_dir: str,
               vocab_size: int) -> dict:
    """EvalResult's fields for a preference run over preference pairs (train/evaluate_pairs.py)."""
    if why := evaluate_pairs.refusal(cfg, options.data):
        raise EvalError([why])
    asked = options.batches or cfg.train.eval_batches * dp_degree(run_dir, cfg)
    pairs = evaluate_pairs.pair_metrics(cfg, model, data_dir, options.split, vocab_size, asked, options.full)
    return {"pairs": pairs, "batches": pairs.pop("batches"), "data": str(Path(options.data).expanduser().resolve()),
            "split": options.split, "seq_len": cfg.train.seq_len, "full_pass": options.full}


def evaluate(run_dir: Path, options: EvalOptions, device: torch.device) -> EvalResult:
    cfg = load_run_config(run_dir)
    loaded = []

    def model() -> tuple[torch.nn.Module, torch.device]:
        if not loaded:  # once, and only after the data was found good
            loaded.extend(load_model(run_dir, options.checkpoint, device))
        return loaded[0], device

    fields = {"loss": None, "perplexity": None, "tokens": 0, "batches": 0, "data": None}
    checked = None
    if options.tasks is not None:  # the harness and the task names checked before any work
        from trainctl.train.harness import checked_tasks, run_tasks

        checked = checked_tasks(run_dir, options)
    if options.data is not None:
        fields.update(loss_over(run_dir, cfg, options, model))
    module, _ = model()
    if checked is not None:
        fields["tasks"], fields["tasks_file"] = run_tasks(run_dir, options, checked, module, device, loaded[1])
    fields.setdefault("seq_len", cfg.train.seq_len)
    return EvalResult(**fields, micro_batch=cfg.train.micro_batch,
                      step=checkpoints.step_of(loaded[1]), checkpoint=str(loaded[1]))


def run(run_dir: Path, options: EvalOptions) -> EvalResult:
    if problems := options.problems():  # the api checked them; a direct `python -m` call is checked here too
        raise EvalError(problems)
    return evaluate(run_dir, options, pick_device(options.device))


def main(argv: list[str] | None = None) -> int:
    """Child entry (`tool_options.child_argv`): 0 on success, 2 for a user error."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return serve(EvalOptions, sys.argv[1:] if argv is None else argv, run)


if __name__ == "__main__":
    from trainctl.core.lean_process import exit_now

    exit_now(main())  # without the teardown of torch's modules (core/lean_process.py)
