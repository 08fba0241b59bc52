"""`trainctl export --verify`: load the written folder with transformers and compare it with trainctl's model.

Converted weights that silently produce garbage (a q/k layout, a bias, a norm in the wrong place) are the
most common conversion failure, and nothing downstream notices until a model generates nonsense. Before
an export is called done, the folder is loaded with `AutoModelForCausalLM.from_pretrained` (fp32, CPU):
- no missing or unexpected keys, and the class its config.json names;
- every tensor equal to the checkpoint's, after the export's dtype cast (the worst one is named);
- logits on fixed tokens equal to trainctl's own model built from the same checkpoint.
A failure raises VerifyError naming what differs; the exporter then removes the folder it was writing.
Both models are held in fp32 host memory at once: this is for the models one verifies on a login node.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from trainctl.config.schema import ModelConfig
from trainctl.models import registry
from trainctl.models.build import build_model
from trainctl.models.hf import to_hf_items

# Logits of the same weights in fp32 differ between trainctl's and transformers' kernels by rounding that grows
# with depth and width (measured: up to 1.1e-4 of the logits' scale on a 200M random model, 3.5e-4 on a deep
# one with sharp attention); a wrong conversion or config is off by O(1e-2 .. 1) of it. The bound is relative
# to the logits' scale; the tensors themselves are compared exactly above.
LOGITS_RTOL = 1e-3
TOKENS = (2, 64)  # batch x sequence of the fixed probe (shortened to the model's context)


class VerifyError(Exception):
    """One line: what differs between the export and the checkpoint (the export is not done)."""


@dataclass(frozen=True)
class Verified:
    architecture: str
    worst_tensor: float
    logits_diff: float
    tokens: tuple[int, int]

    def line(self) -> str:
        return (f"verified: transformers loads it as {self.architecture} with no missing or unexpected keys; every "
                f"tensor matches the checkpoint (max |diff| {self.worst_tensor:.2g}); logits max |diff| "
                f"{self.logits_diff:.2g} over {self.tokens[0]}x{self.tokens[1]} tokens")


def verify_export(folder: Path, weights: dict[str, torch.Tensor], cfg: ModelConfig,
                  dtype: torch.dtype | None) -> Verified:
    """Compare the export at `folder` with `weights` (trainctl names, as checkpointed); raises VerifyError."""
    transformers = _import_transformers()
    cast = {n: (t.to(dtype) if dtype is not None else t).float() for n, t in weights.items()}
    with _quiet_logs():
        theirs = _load(transformers, folder)
    architecture = type(theirs).__name__
    expected = registry.spec(cfg.family).hf_architectures[0]
    if architecture != expected:
        raise VerifyError(f"{folder}: transformers built {architecture}, not {expected}")
    worst = _compare_tensors(_hub_names(theirs.state_dict(), cfg), cast, cfg)
    ours = build_model(cfg, "cpu")
    ours.init_weights()  # the rotary table; every parameter is overwritten below
    missing, unexpected = ours.load_state_dict(cast, strict=False)
    if unexpected or [m for m in missing if not (cfg.tie_embeddings and m == "output.weight")]:
        raise VerifyError(f"the checkpoint does not fill trainctl's model: missing {missing[:3]}, "
                          f"extra {unexpected[:3]}")
    with _quiet_logs():
        logits_diff = _compare_logits(ours.eval(), theirs.eval(), cfg)
    return Verified(architecture, worst, logits_diff, _shape(cfg))


@contextlib.contextmanager
def _quiet_logs() -> Iterator[None]:
    """No log records while transformers imports and loads: torch's and torchao's handlers hold the real stderr
    (redirect_stderr cannot catch them), and their warnings would break the command's one-line output."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(previous)


def _import_transformers():
    """transformers, or VerifyError: not installed, or installed but broken (e.g. built for another torch)."""
    try:
        with _quiet_logs(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import transformers
    except ModuleNotFoundError as exc:
        if exc.name != "transformers":
            raise VerifyError(f"--verify: transformers does not import ({_first_line(exc)}); repair it "
                              "(pip install -U transformers) or export without --verify") from None
        raise VerifyError("--verify loads the export with transformers, which is not installed here; "
                          "pip install transformers, or export without --verify") from None
    except Exception as exc:  # noqa: BLE001 (a broken install raises anything at import)
        raise VerifyError(f"--verify: transformers does not import ({_first_line(exc)}); repair it "
                          "(pip install -U transformers) or export without --verify") from None
    return transformers


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__


def _load(transformers, folder: Path):
    quiet = io.StringIO()
    try:
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            model, info = transformers.AutoModelForCausalLM.from_pretrained(
                folder, dtype=torch.float32, output_loading_info=True)
    except Exception as exc:  # transformers raises many kinds; any of them means the folder does not load
        raise VerifyError(f"{folder}: transformers cannot load it: {str(exc).splitlines()[0][:200]}") from None
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        if info.get(kind):
            names = sorted(str(k) for k in info[kind])
            raise VerifyError(f"{folder}: transformers reports {kind.replace('_', ' ')}: {', '.join(names[:3])}"
                              f"{' ...' if len(names) > 3 else ''}")
    return model


def _compare_tensors(loaded: dict[str, torch.Tensor], ours: dict[str, torch.Tensor], cfg: ModelConfig) -> float:
    """The largest |difference| over every tensor; VerifyError naming the first that is not equal."""
    worst = 0.0
    for name, tensor in ours.items():
        if cfg.tie_embeddings and name == "output.weight":
            continue
        for hf_name, expected in to_hf_items(name, tensor, cfg):
            got = loaded.get(hf_name)
            if got is None or tuple(got.shape) != tuple(expected.shape):
                raise VerifyError(f"{hf_name}: {'absent' if got is None else list(got.shape)} in the loaded model, "
                                  f"expected {list(expected.shape)} from {name}")
            diff = (got.float() - expected).abs().max().item() if expected.numel() else 0.0
            if not diff <= 0:  # the same bytes through the same cast: anything else is a conversion error
                raise VerifyError(f"{hf_name}: differs from the checkpoint's {name} by up to {diff:.3g}")
            worst = max(worst, diff)
    return worst


def _hub_names(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """transformers' state dict under the Hub's names (its fused in-memory experts split per expert)."""
    split = getattr(registry.spec(cfg.family), "hub_names_of_fused", lambda *_: None)
    out = {}
    for name, tensor in state.items():
        out.update(split(name, tensor) or [(name, tensor)])
    return out


def _shape(cfg: ModelConfig) -> tuple[int, int]:
    return TOKENS[0], min(TOKENS[1], cfg.max_seq_len)


@torch.no_grad()
def _compare_logits(ours: torch.nn.Module, theirs: torch.nn.Module, cfg: ModelConfig) -> float:
    tokens = torch.randint(0, cfg.vocab_size, _shape(cfg), generator=torch.Generator().manual_seed(0))
    expected, got = ours(tokens).float(), theirs(tokens).logits.float()
    diff = (got - expected).abs()
    worst = diff.max().item()
    bound = LOGITS_RTOL * max(1.0, expected.abs().max().item())
    if not math.isfinite(worst) or worst > bound:
        b, t, v = (int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
        raise VerifyError(f"logits differ from trainctl's by up to {worst:.3g} (bound {bound:.2g}) at batch {b}, "
                          f"position {t}, token id {v}: the weights load but do not compute the same model")
    return worst
