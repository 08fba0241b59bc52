"""Sample from a run's checkpoint on one device: `trainctl generate` runs this module (the CLI stays torch-free).

    python -m trainctl.models.generate RUN_DIR (--prompt TEXT | --prompts FILE | --prompt-ids 1,2,3)
        [--checkpoint C] [--max-new-tokens N] [--temperature T] [--top-p P] [--seed S] [--chat] [--device D]

The newest valid checkpoint (or a named one that verifies), read with DCP in one process as the export reads it,
into the family's model; the run's own tokenizer (models/run_tokens.py). Decoding uses a key/value cache
(models/kv_cache.py). Greedy (temperature 0) picks the argmax of the fp32 logits, as transformers' greedy
generate does, so the output equals it on `trainctl export` of the same checkpoint. Sampling divides by the
temperature, keeps the smallest set of tokens whose probability reaches --top-p (transformers' TopPLogitsWarper)
and draws with a generator seeded by --seed: the same seed gives the same text. Generation stops at an
end-of-sequence id (the tokenizer's, generation_config.json's) or after --max-new-tokens.

One prompt prints its completion; --prompts FILE (one prompt per line) prints one JSON object per line.
"""

from __future__ import annotations

import argparse
import json
import stat
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from trainctl.core.errors import UserError
from trainctl.models.build import build_model
from trainctl.models.checkpoint_reader import (
    check_against_config,
    find_checkpoint,
    model_entries,
    read_model_config,
    read_tensors,
)
from trainctl.models.kv_cache import KVCache, forward_cached
from trainctl.models.run_tokens import RunTokens, run_tokens

MAX_PROMPTS_BYTES = 64 << 20


class GenerateError(UserError):
    """A problem the user can fix; one line."""


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0


def load_model(run_dir: Path, checkpoint: str | None, device: torch.device) -> tuple[nn.Module, Path]:
    """The run's model with a verified checkpoint's weights, in eval mode on `device`, and the checkpoint read.

    The seam for adapters (LoRA): a run whose checkpoint holds adapter tensors gets them merged or attached here,
    after the base weights are in place; the decode path calls each Linear, so wrapped ones work as they are.
    """
    cfg = read_model_config(run_dir)
    ckpt = find_checkpoint(run_dir, checkpoint)
    entries = model_entries(ckpt)
    names = check_against_config(entries, cfg, ckpt)
    tensors = read_tensors(ckpt, entries, names)
    model = build_model(cfg, device="meta")
    model.to_empty(device=device)
    if cfg.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight  # to_empty unties them (see Decoder.init_weights)
    with torch.no_grad():
        model.freqs.copy_(model._rope_table(device=device))  # not in the checkpoint: derived from the config
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [n for n in missing if not (cfg.tie_embeddings and n == "output.weight")]
    assert not missing and not unexpected, (missing, unexpected)  # check_against_config matched the names
    return model.eval(), ckpt


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """The next id from one position's logits [vocab]: the argmax when greedy, else a top-p draw."""
    logits = logits.float()
    if sampling.temperature == 0:
        return int(logits.argmax())
    logits = logits / sampling.temperature
    if sampling.top_p < 1.0:
        # As transformers' TopPLogitsWarper: drop the tokens whose ascending cumulative probability stays at or
        # below 1 - top_p, keeping at least the most likely one.
        ordered, order = logits.sort(descending=False)
        drop = ordered.softmax(-1).cumsum(-1) <= 1 - sampling.top_p
        drop[-1] = False
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


@torch.no_grad()
def generate_ids(model: nn.Module, prompt: list[int], sampling: Sampling, eos_ids: list[int],
                 use_cache: bool = True, device: torch.device | None = None,
                 stop: Callable[[list[int]], bool] | None = None) -> list[int]:
    """The new ids after `prompt` (an end-of-sequence id included when it stopped there); `stop(new ids)`: stop
    early when it says so (--chat's end-of-turn text)."""
    device = device or model.freqs.device
    generator = None
    if sampling.temperature > 0:
        generator = torch.Generator(device=device).manual_seed(sampling.seed)
    cache = KVCache()
    tokens = torch.tensor([prompt], dtype=torch.long, device=device)
    out: list[int] = []
    for _ in range(sampling.max_new_tokens):
        logits = forward_cached(model, tokens, cache) if use_cache else model(tokens)
        token = next_token(logits[0, -1], sampling, generator)
        out.append(token)
        if token in eos_ids or (stop is not None and stop(out)):
            break
        step = torch.tensor([[token]], dtype=torch.long, device=device)
        tokens = step if use_cache else torch.cat([tokens, step], dim=1)
    return out


def read_prompts(path: Path) -> list[str]:
    """One prompt per non-empty line of a regular file; a FIFO or device is refused (it could block forever)."""
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise GenerateError([f"--prompts {path}: {exc.strerror or exc}; pass a text file, one prompt per line"]) \
            from None
    if not stat.S_ISREG(mode) or path.stat().st_size > MAX_PROMPTS_BYTES:
        raise GenerateError([f"--prompts {path}: not a regular file of at most {MAX_PROMPTS_BYTES >> 20} MiB; "
                             "pass a text file, one prompt per line"])
    try:
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise GenerateError([f"--prompts {path}: unreadable as UTF-8 text ({exc}); pass a text file"]) from None
    if not lines:
        raise GenerateError([f"--prompts {path}: no prompt in it (every line is empty); write one prompt per line"])
    return lines


def prompt_ids(text: str, tokens: RunTokens, chat: bool) -> list[int]:
    ids = tokens.encode(tokens.chat_prompt(text) if chat else text)
    if not ids:
        raise GenerateError(["--prompt: encodes to no tokens; give some text"])
    return ids


def fit_to_context(prompt: list[int], sampling: Sampling, max_seq_len: int) -> Sampling:
    """`sampling` with max_new_tokens cut to what fits in model.max_seq_len (said on stderr), or refused."""
    room = max_seq_len - len(prompt)
    if room <= 0:
        raise GenerateError([f"--prompt: {len(prompt)} tokens, no room for a new one within model.max_seq_len="
                             f"{max_seq_len}; shorten the prompt"])
    if sampling.max_new_tokens > room:
        print(f"warning: --max-new-tokens {sampling.max_new_tokens} cut to {room}: the prompt has {len(prompt)} "
              f"tokens and model.max_seq_len={max_seq_len}", file=sys.stderr)
        return Sampling(room, sampling.temperature, sampling.top_p, sampling.seed)
    return sampling


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(",", " ").split()]
    except ValueError:
        raise GenerateError([f"--prompt-ids {text}: not a list of token ids; write e.g. 1,2,3"]) from None
    if not ids or min(ids) < 0:
        raise GenerateError([f"--prompt-ids {text}: expected non-negative token ids, e.g. 1,2,3"])
    return ids


def pick_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise GenerateError([f"--device {name}: not a device; use cpu or cuda"]) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise GenerateError([f"--device {name}: no CUDA device here; use cpu"])
    return device


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainctl.models.generate", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--checkpoint")
    given = parser.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt")
    given.add_argument("--prompts", type=Path)
    given.add_argument("--prompt-ids")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chat", action="store_true")
    parser.add_argument("--device")
    return parser.parse_args(argv)


def check_sampling(args: argparse.Namespace) -> Sampling:
    if args.max_new_tokens < 1:
        raise GenerateError([f"--max-new-tokens {args.max_new_tokens}: must be at least 1"])
    if not args.temperature >= 0:
        raise GenerateError([f"--temperature {args.temperature}: must be >= 0 (0: greedy)"])
    if not 0 < args.top_p <= 1:
        raise GenerateError([f"--top-p {args.top_p}: must be in (0, 1]"])
    return Sampling(args.max_new_tokens, args.temperature, args.top_p, args.seed)


def run(args: argparse.Namespace) -> None:
    sampling = check_sampling(args)
    if args.prompt is not None and not args.prompt.strip():
        raise GenerateError(["--prompt '': empty; give some text, or --prompts FILE"])
    prompts = read_prompts(args.prompts) if args.prompts is not None else [args.prompt or args.prompt_ids]
    device = pick_device(args.device)
    read_model_config(args.run_dir)  # not a run directory: refused before the tokenizer is looked for
    tokens = run_tokens(args.run_dir)
    if args.chat and args.prompt_ids is not None:
        raise GenerateError(["--chat with --prompt-ids: ids are already what the model reads; leave --chat out"])
    encoded = [parse_ids(p) if args.prompt_ids is not None else prompt_ids(p, tokens, args.chat) for p in prompts]
    model, ckpt = load_model(args.run_dir, args.checkpoint, device)
    vocab = model.cfg.vocab_size
    if max(max(ids) for ids in encoded) >= vocab:
        key = "--prompt-ids" if args.prompt_ids is not None else "the run's tokenizer"
        raise GenerateError([f"{key}: token id {max(max(ids) for ids in encoded)} >= model.vocab_size={vocab}; "
                             "the model has no embedding for it (use ids below it)"])
    end = tokens.end_of_turn() if args.chat else None
    # Each new token holds at least one byte of text: the last len(end) bytes' worth of tokens is enough to look at.
    tail = len(end.encode("utf-8")) + 1 if end else 0
    stop = (lambda new: end in tokens.decode(new[-tail:])) if end else None
    for text, ids in zip(prompts, encoded, strict=True):
        new = generate_ids(model, ids, fit_to_context(ids, sampling, model.cfg.max_seq_len), tokens.eos_ids,
                           stop=stop)
        shown = new[:-1] if new and new[-1] in tokens.eos_ids else new
        completion = tokens.decode(shown) if args.prompt_ids is None else " ".join(map(str, shown))
        completion = completion.split(end)[0] if end else completion  # the answer, without the end-of-turn text
        if args.prompts is None:
            print(completion, flush=True)
        else:
            print(json.dumps({"prompt": text, "completion": completion, "ids": new}, ensure_ascii=False), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            run(args)
    except UserError as exc:  # GenerateError, ExportError, TokenizerError: one line each
        print(f"error: {'; '.join(exc.problems)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
