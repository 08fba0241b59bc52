"""`trainctl export --verify`: an export is done only when transformers loads it and computes what trainctl does.

Converted weights that silently give garbage are the commonest complaint against every conversion tool: a
q/k rotary layout off by a permutation, a norm under the wrong name, a config field transformers reads
differently. So after the files are written (still in the export's temporary folder), this module

1. loads the folder with `transformers.AutoModelForCausalLM` and refuses any missing, unexpected or
   mismatched key (transformers would fill those with a random init and only log it);
2. compares every tensor transformers loaded, mapped back to trainctl's names and rotary layout, with the
   checkpoint's (cast to the export's dtype): they must be equal bit for bit, since the conversion only
   renames and permutes; the worst one is named;
3. runs trainctl's own model built from the same checkpoint tensors and the loaded model on fixed tokens,
   both in fp32 on the CPU, and requires max |logits difference| <= TOLERANCE (1e-3) x max(1, max |logit|); when
   they differ, it names the worst (sequence, position, vocab id) and the first block whose output differs,
   which is where a wrong conversion shows first. Step 2 cannot see a mistake made the same way in both
   directions of the name/layout map (it maps back with the inverse); step 3 can.

A failure raises VerifyMismatch (exit 1, one line): the export then never reaches its output path (export.py
removes the temporary folder), since a marked folder would still be loaded, copied and uploaded by tools
that ignore the mark; the checkpoint is untouched, so nothing is lost, and exporting without --verify writes
the same files for inspection. Memory: the checkpoint's model and transformers' copy, both in fp32.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from trainctl.config.schema import ModelConfig
from trainctl.models.export import ExportError, _first_line, read_tensors
from trainctl.models.hf import from_hf
from trainctl.models.llama import build_model

# Of max(1, max |logit|). fp32 on CPU differs only in rounding, but that grows with size and sharp attention:
# 1.1e-4 measured on a 200M-parameter model (12 blocks, peaked attention), where a q/k layout mistake gave 1.3;
# on a tiny trained model (weights ~0.02) the same mistake gave 6e-3, still above this.
TOLERANCE = 1e-3
BATCH, MAX_TOKENS, SEED = 2, 64, 0


class VerifyMismatch(ExportError):  # noqa: N818 (a refusal, like ExportError)
    """The export does not reproduce the checkpoint's model; not the user's doing, so not exit 2."""

    exit_code = 1


def require_transformers() -> None:
    """Refuse --verify up front (before anything is written) when transformers is missing or does not import
    (e.g. a version that does not fit this torch)."""
    if importlib.util.find_spec("transformers") is None:
        raise ExportError(f"--verify: transformers is not installed in {sys.executable}'s environment; "
                          "pip install transformers, or export without --verify")
    try:
        with quiet():
            pass  # quiet() imports transformers
    except Exception as exc:  # noqa: BLE001 (a broken install raises anything at import)
        raise ExportError(f"--verify: transformers does not import ({_first_line(exc)}); repair it "
                          "(pip install -U transformers) or export without --verify") from None


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """No log lines, warnings or progress bars from transformers (and what it imports) while it loads: the
    command's output stays one line; what matters (missing keys) is read from the loading info instead."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import transformers

            transformers.utils.logging.disable_progress_bar()
            yield
    finally:
        logging.disable(previous)


def fixed_tokens(cfg: ModelConfig) -> torch.Tensor:
    """The same ids every time: [BATCH, min(MAX_TOKENS, max_seq_len)]."""
    generator = torch.Generator().manual_seed(SEED)
    return torch.randint(0, cfg.vocab_size, (BATCH, min(MAX_TOKENS, cfg.max_seq_len)), generator=generator)


def checkpoint_state(ckpt: Path, entries: dict, names: list[str], dtype: torch.dtype | None) -> dict:
    """The checkpoint's model tensors by trainctl name, rounded to the export's dtype, in fp32."""
    return {n: (t if dtype is None else t.to(dtype)).float() for n, t in read_tensors(ckpt, entries, names).items()}


def trainctl_model(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> nn.Module:
    """trainctl's model on the CPU in fp32 holding exactly `state` (a tied head is the embedding)."""
    model = build_model(cfg, "meta").to_empty(device="cpu")
    model.init_weights()  # the derived buffers (RoPE table) and the tie; every parameter is then overwritten
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"output.weight"}, (missing, unexpected)  # export checked names
    return model.float().eval()


def load_export(folder: Path, out: Path) -> nn.Module:
    """transformers' model of the export in fp32; refused when it fails to load or loads with key problems."""
    with quiet():
        from transformers import AutoModelForCausalLM

        try:
            model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
        except Exception as exc:  # noqa: BLE001 (whatever transformers raises, the export is not loadable)
            raise VerifyMismatch(f"verify: {out}: transformers cannot load the export: {_first_line(exc)}") from None
    problems = [f"{kind.replace('_', ' ')} {', '.join(map(str, keys[:3]))}{' ...' if len(keys) > 3 else ''}"
                for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")
                if (keys := sorted(info.get(kind) or [], key=str))]
    problems += [str(msg).splitlines()[0] for msg in info.get("error_msgs") or []]
    if problems:
        raise VerifyMismatch(f"verify: {out}: transformers loads the export with {'; '.join(problems)}")
    return model.float().eval()


def worst_tensor(hf_model: nn.Module, state: dict[str, torch.Tensor], cfg: ModelConfig) -> tuple[str, str, float]:
    """(transformers' name, trainctl's name, max abs diff) of the loaded tensor furthest from the checkpoint's."""
    worst = ("", "", 0.0)
    for key, tensor in hf_model.state_dict().items():
        ours, back = from_hf(key, tensor.detach(), cfg)
        if ours not in state:
            continue  # a buffer trainctl does not keep (rotary tables)
        if back.shape != state[ours].shape:
            return key, ours, float("inf")
        diff = (back - state[ours]).abs().max().item()
        if diff > worst[2] or not worst[0]:
            worst = (key, ours, diff)
    return worst


def block_outputs(blocks: list[nn.Module], run) -> list[torch.Tensor]:
    """Each block's output hidden states during `run()` (a decoder layer may return a tuple)."""
    outputs: list[torch.Tensor] = []

    def keep(_module, _args, output) -> None:
        outputs.append((output[0] if isinstance(output, tuple) else output).detach())

    handles = [block.register_forward_hook(keep) for block in blocks]
    try:
        logits = run()
    finally:
        for handle in handles:
            handle.remove()
    return [logits, *outputs]


def first_divergent_block(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> str:
    """Where the difference starts: the first block output off by more than TOLERANCE of its own scale (the
    residual stream can be far larger than the logits, and its rounding noise with it)."""
    for index, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        diff = (a - b.reshape(a.shape)).abs().max().item() if a.numel() == b.numel() else float("inf")
        if not diff <= TOLERANCE * max(1.0, a.abs().max().item()):
            return f"the first block whose output differs is layers.{index} (max abs diff {diff:.3g})"
    return "every block's output agrees, so the final norm or the head differs"


def compare_logits(model: nn.Module, hf_model: nn.Module, cfg: ModelConfig, out: Path) -> str:
    """Refuse unequal logits on the fixed tokens; returns the one-line summary of a pass."""
    tokens = fixed_tokens(cfg)
    with torch.no_grad(), quiet():
        ours = block_outputs(list(model.layers.values()), lambda: model(tokens))
        theirs = block_outputs(list(hf_model.model.layers), lambda: hf_model(tokens).logits)
    diff = (ours[0] - theirs[0]).abs()
    tol = TOLERANCE * max(1.0, ours[0].abs().max().item())
    worst = diff.max().item()
    where = f"over {BATCH}x{tokens.shape[1]} tokens, tolerance {tol:.2g} = {TOLERANCE:g} x max(1, max |logit|)"
    if not worst <= tol:  # NaN fails too
        seq, pos, vocab = (int(i) for i in torch.unravel_index(diff.nan_to_num(float("inf")).argmax(), diff.shape))
        block = first_divergent_block(ours[1:], theirs[1:])
        raise VerifyMismatch(f"verify: {out}: transformers' logits differ from trainctl's by {worst:.3g} {where}, "
                             f"worst at sequence {seq} position {pos} vocab id {vocab}; {block}")
    return f"max abs logits difference {worst:.2g} {where}"


def verify_export(folder: Path, out: Path, ckpt: Path, entries: dict, names: list[str], cfg: ModelConfig,
                  dtype: torch.dtype | None) -> str:
    """Check the export written in `folder` (to be renamed to `out`) against checkpoint `ckpt`; returns the
    summary line, or raises VerifyMismatch naming what differs."""
    # At most two copies of the model at a time: the checkpoint's tensors live on only inside trainctl's model.
    model = trainctl_model(cfg, checkpoint_state(ckpt, entries, names, dtype))
    hf_model = load_export(folder, out)
    key, ours, diff = worst_tensor(hf_model, model.state_dict(), cfg)
    if diff != 0:
        raise VerifyMismatch(f"verify: {out}: {key} as transformers loads it differs from the checkpoint's {ours} "
                             f"by up to {diff:.3g} (the conversion only renames and permutes, so it must be equal)")
    summary = compare_logits(model, hf_model, cfg, out)
    return f"verified with transformers: no missing or unexpected keys, every tensor equal, {summary}"

