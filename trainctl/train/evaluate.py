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
import warnings
from pathlib import Path

import torch

from trainctl.config.load import load_run_config
from trainctl.config.schema import DataConfig, RunConfig
from trainctl.core import checkpoints
from trainctl.core import rundir as layout
from trainctl.core.errors import UserError
from trainctl.core.tool_options import EvalOptions, EvalResult, serve
from trainctl.data import format as dataset
from trainctl.models.checkpoint_reader import read_model_config
from trainctl.models.generate import load_model, pick_device
from trainctl.models.loss_head import IGNORE_INDEX
from trainctl.models.run_tokens import run_tokens
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
                         f"tokenizer (--tokenizer {run_dir / layout.TOKENIZER}/tokenizer.json)"])
    if meta.tokenizer.vocab_size > vocab_size:
        raise EvalError([f"--data {data_dir}: ids up to {meta.tokenizer.vocab_size - 1}, above the model's "
                         f"vocab_size={vocab_size}; evaluate data of the run's tokenizer"])
    return meta


def dp_degree(run_dir: Path, cfg: RunConfig) -> int:
    """How many data-parallel ranks evaluated disjoint samples: plan.json's, else the config's positive sizes."""
    dims = layout.read_json(run_dir / layout.PLAN).get("dims") or {}
    if isinstance(dims.get("dp"), int) and dims["dp"] > 0:
        return dims["dp"]
    return max(1, cfg.sharding.dp_replicate) * max(1, cfg.sharding.dp_shard)


def val_batches(cfg: RunConfig, data_dir: str, batches: int, vocab_size: int) -> list:
    train = cfg.train
    data = DataConfig(kind="memmap", datasets=[data_dir], vocab_size=vocab_size)
    try:
        source = TokenBatches(data, "val", train.seq_len, train.micro_batch, train.micro_batch, 1, 0, 1, seed=0)
        return source.eval_batches(batches)
    except DataError as exc:
        raise EvalError([f"--data {data_dir}: {exc}"]) from None


@torch.no_grad()
def loss_totals(model: torch.nn.Module, batches: list, device: torch.device) -> tuple[float, int]:
    """(summed token loss, counted targets) over the batches, as the worker's eval_totals sums them."""
    total, count = 0.0, 0
    for inputs, targets in batches:
        inputs, targets = inputs.to(device), targets.to(device)
        total += float(token_loss_sum(model, inputs, targets).double())
        count += int((targets != IGNORE_INDEX).sum())
    return total, count


def evaluate(run_dir: Path, data_dir: str, checkpoint: str | None, batches: int | None,
             device: torch.device) -> EvalResult:
    model_cfg = read_model_config(run_dir)
    cfg = load_run_config(run_dir)
    check_dataset(run_dir, data_dir, model_cfg.vocab_size)
    batches = batches or cfg.train.eval_batches * dp_degree(run_dir, cfg)
    data = val_batches(cfg, data_dir, batches, model_cfg.vocab_size)
    model, ckpt = load_model(run_dir, checkpoint, device)
    total, count = loss_totals(model, data, device)
    if count == 0:
        raise EvalError([f"--data {data_dir}: no target of the {batches} val batches counts in the loss (every "
                         "token masked); evaluate more --batches or a dataset with answers in its val split"])
    loss = total / count
    return EvalResult(loss, math.exp(min(loss, 700.0)), count, batches, cfg.train.seq_len, cfg.train.micro_batch,
                      checkpoints.step_of(ckpt), str(ckpt), str(Path(data_dir).resolve()))


def run(run_dir: Path, options: EvalOptions) -> EvalResult:
    if problems := options.problems():  # the api checked them; a direct `python -m` call is checked here too
        raise EvalError(problems)
    return evaluate(run_dir, options.data, options.checkpoint, options.batches, pick_device(options.device))


def main(argv: list[str] | None = None) -> int:
    """Child entry (`tool_options.child_argv`): 0 on success, 2 for a user error."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return serve(EvalOptions, sys.argv[1:] if argv is None else argv, run)


if __name__ == "__main__":
    sys.exit(main())
