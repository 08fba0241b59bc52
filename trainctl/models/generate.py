"""Sample from a run's checkpoint on one device: `trainctl generate` runs this module (the CLI stays torch-free).

    python -m trainctl.models.generate RUN_DIR OPTIONS_JSON [RESULT_JSON]

(the options: core/tool_options.GenerateOptions as JSON; the completions go to RESULT_JSON, else to stdout.)

The newest valid checkpoint (or a named one that verifies), read with DCP in one process as the export reads it,
into the family's model; the run's own tokenizer (models/run_tokens.py). Decoding uses a key/value cache
(models/kv_cache.py). Greedy (temperature 0) picks the argmax of the fp32 logits, as transformers' greedy
generate does, so the output equals it on `trainctl export` of the same checkpoint. Sampling divides by the
temperature, keeps the smallest set of tokens whose probability reaches --top-p (transformers' TopPLogitsWarper)
and draws with a generator seeded by --seed: the same seed gives the same text. Generation stops at an
end-of-sequence id (the tokenizer's, generation_config.json's) or after --max-new-tokens.

One prompt's completion is printed as it is; --prompts FILE (one prompt per line) prints one JSON object per line.
"""

from __future__ import annotations

import stat
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from trainctl.core.errors import UserError
from trainctl.core.tool_options import Completion, Generated, GenerateOptions, serve
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


def read_prompts(path: Path) -> list[tuple[str, str]]:
    """(`--prompts FILE line N`, the prompt) of each non-empty line of a regular file; a FIFO or device is refused
    (it could block forever)."""
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise GenerateError([f"--prompts {path}: {exc.strerror or exc}; pass a text file, one prompt per line"]) \
            from None
    if not stat.S_ISREG(mode) or path.stat().st_size > MAX_PROMPTS_BYTES:
        raise GenerateError([f"--prompts {path}: not a regular file of at most {MAX_PROMPTS_BYTES >> 20} MiB; "
                             "pass a text file, one prompt per line"])
    try:
        lines = [(f"--prompts {path} line {n}", line)
                 for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise GenerateError([f"--prompts {path}: unreadable as UTF-8 text ({exc}); pass a text file"]) from None
    if not lines:
        raise GenerateError([f"--prompts {path}: no prompt in it (every line is empty); write one prompt per line"])
    return lines


def prompt_ids(text: str, tokens: RunTokens, chat: bool, label: str = "--prompt") -> list[int]:
    ids = tokens.encode(tokens.chat_prompt(text) if chat else text)
    if not ids:
        raise GenerateError([f"{label}: encodes to no tokens; give some text"])
    return ids


def fit_to_context(prompt: list[int], sampling: Sampling, max_seq_len: int, label: str = "--prompt") -> Sampling:
    """`sampling` with max_new_tokens cut to what fits in model.max_seq_len (said on stderr), or refused."""
    room = max_seq_len - len(prompt)
    if room <= 0:
        raise GenerateError([f"{label}: {len(prompt)} tokens, no room for a new one within model.max_seq_len="
                             f"{max_seq_len}; shorten the prompt"])
    if sampling.max_new_tokens > room:
        what = "the prompt" if label == "--prompt" else label
        print(f"warning: --max-new-tokens {sampling.max_new_tokens} cut to {room}: {what} has {len(prompt)} "
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


def without_end(text: str, end: str) -> str:
    """The answer without the end-of-turn marker, and without the start of one that --max-new-tokens cut short
    (`Yes.<|im` of a byte-spelled `<|im_end|>`): the model was writing the marker, not the answer."""
    text = text.split(end)[0]
    cut = next((n for n in range(len(end) - 1, 0, -1) if text.endswith(end[:n])), 0)
    return text[:-cut] if cut else text


def run(run_dir: Path, options: GenerateOptions) -> Generated:
    """Continue the prompts `options` name with the run's checkpoint; their completions (raises UserError)."""
    if problems := options.problems():  # the api checked them; a direct `python -m` call is checked here too
        raise GenerateError(problems)
    sampling = Sampling(options.max_new_tokens, options.temperature, options.top_p, options.seed)
    from_file, as_ids = options.prompts is not None, options.prompt_ids is not None
    labelled = read_prompts(Path(options.prompts)) if from_file else \
        [("--prompt-ids" if as_ids else "--prompt", options.prompt or options.prompt_ids)]
    prompts = [text for _, text in labelled]
    device = pick_device(options.device)
    read_model_config(run_dir)  # not a run directory: refused before the tokenizer is looked for
    tokens = run_tokens(run_dir)
    model, _ = load_model(run_dir, options.checkpoint, device)
    end = tokens.end_of_turn() if options.chat else None
    # Each new token holds at least one byte of text: the last len(end) bytes' worth of tokens is enough to look at.
    tail = len(end.encode("utf-8")) + 1 if end else 0
    stop = (lambda new: end in tokens.decode(new[-tail:])) if end else None
    # Every prompt is checked before the first is answered; in a file, a line that cannot be answered (no token,
    # no room in the context, an id past the vocabulary) gets its reason in its own JSON line, the others answers.
    checked = [_checked_prompt(label, p, tokens, options, sampling, model.cfg) for label, p in labelled]
    if not from_file and isinstance(checked[0], GenerateError):
        raise checked[0]
    completions = []
    for text, item in zip(prompts, checked, strict=True):
        if isinstance(item, GenerateError):
            completions.append(Completion(text, "", [], error=str(item)))
            continue
        ids, fit = item
        new = generate_ids(model, ids, fit, tokens.eos_ids, stop=stop)
        shown = new[:-1] if new and new[-1] in tokens.eos_ids else new
        completion = " ".join(map(str, shown)) if as_ids else tokens.decode(shown)
        completion = without_end(completion, end) if end else completion
        completions.append(Completion(text, completion, new))
    if failed := [c for c in completions if c.error]:
        print(f"warning: {len(failed)} of {len(completions)} prompts not answered; their JSON lines say why "
              f"(\"error\"), first: {failed[0].error}", file=sys.stderr)
    return Generated(completions, from_file)


def _checked_prompt(label: str, text: str, tokens: RunTokens, options: GenerateOptions, sampling: Sampling,
                    model_cfg) -> tuple[list[int], Sampling] | GenerateError:
    """A prompt's ids and its sampling cut to the context, or why it cannot be answered (returned, not raised)."""
    try:
        ids = parse_ids(text) if options.prompt_ids is not None else prompt_ids(text, tokens, options.chat, label)
        if max(ids) >= model_cfg.vocab_size:
            key = "--prompt-ids" if options.prompt_ids is not None else f"{label}: the run's tokenizer"
            raise GenerateError([f"{key}: token id {max(ids)} >= model.vocab_size={model_cfg.vocab_size}; "
                                 "the model has no embedding for it (use ids below it)"])
        return ids, fit_to_context(ids, sampling, model_cfg.max_seq_len, label)
    except GenerateError as exc:
        return exc


def main(argv: list[str] | None = None) -> int:
    """Child entry (`tool_options.child_argv`): 0 on success, 2 for a user error."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return serve(GenerateOptions, sys.argv[1:] if argv is None else argv, run)


if __name__ == "__main__":
    from trainctl.core.lean_process import exit_now

    exit_now(main())  # without the teardown of torch's modules (core/lean_process.py)
