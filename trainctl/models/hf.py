"""Hugging Face weights in and out for every family: tensor names, the rotary layout, config.json, loading.

The names and which tensors hold rotary rows are the family's (models/<family>/spec.py). trainctl rotates
interleaved pairs (x[2i], x[2i+1]) of each head (models/common/rope.py, as Meta's reference code);
transformers rotates halves (x[i], x[i + head_dim/2]). The attention outputs agree when the rows of every q
and k head are reordered (and with them q/k biases and per-head q/k norm weights): `to_hf_rows` and
`from_hf_rows` (inverses of each other).

Loading (`load_hf_weights`) works in every layout the worker builds (one process, DDP, FSDP2, HSDP, TP,
pipeline stages): each rank reads one safetensors file at a time, one tensor at a time, and copies
into each parameter only its own slice (a DTensor's local shard); no rank ever holds the whole model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from trainctl.config.hf_config import weight_files
from trainctl.config.hf_tensors import BUFFER_SUFFIXES, HEAD, expected_tensors
from trainctl.config.schema import ModelConfig
from trainctl.core.lora import is_adapter
from trainctl.models import registry
from trainctl.models.common.init import fill

# Segments that wrappers (DDP, torch.compile, activation checkpointing, FSDP1) add to parameter names.
WRAPPER_SEGMENTS = ("module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


class HFWeightsError(Exception):
    """The folder's weights do not fit the model (one line, naming checkpoint.init_from)."""


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _spec(cfg: ModelConfig | None):
    return registry.spec(cfg.family if cfg is not None else "llama")


def to_hf_name(name: str, cfg: ModelConfig | None = None) -> str:
    """`layers.3.attention.wq.weight` -> `model.layers.3.self_attn.q_proj.weight` (the family's name map)."""
    return _spec(cfg).to_hf_name(name)


def from_hf_name(name: str, cfg: ModelConfig | None = None) -> str | None:
    """The trainctl name of a Hugging Face tensor; None for one trainctl has no use for (rotary buffers)."""
    return _spec(cfg).from_hf_name(name)


def to_hf_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of each head from interleaved pairs (2i, 2i+1) to halves (i, i + head_dim/2) (1-D biases too)."""
    head_dim = w.shape[0] // heads
    return w.reshape(heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def from_hf_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of `to_hf_rows`."""
    head_dim = w.shape[0] // heads
    return w.reshape(heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(w.shape)


def to_hf(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> tuple[str, torch.Tensor]:
    heads = _spec(cfg).rotary_heads(name, cfg)
    return to_hf_name(name, cfg), (to_hf_rows(tensor, heads) if heads else tensor).contiguous()


def to_hf_items(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """A trainctl tensor as the Hugging Face tensors it is: one, or one per expert of a stacked expert weight
    ([E, in, out] -> E tensors [out, in], the Hub's layout; models/common/moe_shape.py)."""
    spec = _spec(cfg)
    experts = getattr(spec, "expert_hf_tensors", lambda *_: None)(name, cfg)
    if experts is None:
        return [to_hf(name, tensor, cfg)]
    return [(hf_name, tensor[e].t().contiguous()) for e, (hf_name, _) in enumerate(experts)]


def from_hf(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> tuple[str | None, torch.Tensor]:
    ours = from_hf_name(name, cfg)
    heads = _spec(cfg).rotary_heads(ours, cfg) if ours else None
    return ours, (from_hf_rows(tensor, heads) if heads else tensor)


def hf_config(cfg: ModelConfig, dtype: torch.dtype, eos_id: int | None = None, bos_id: int | None = None) -> dict:
    """config.json for transformers' class of the family: every field it needs to rebuild this model exactly."""
    data = {**_spec(cfg).to_hf(cfg), "torch_dtype": str(dtype).removeprefix("torch.")}
    if eos_id is not None:
        data["eos_token_id"] = eos_id
    if bos_id is not None:
        data["bos_token_id"] = bos_id
    return data


def _clean(name: str, pipeline: bool) -> str:
    parts = [p for p in name.split(".") if p not in WRAPPER_SEGMENTS]
    return ".".join(parts[1:] if pipeline else parts)  # a pipeline's ModuleList prefixes the part's index


def local_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """This rank's parameters by their trainctl name (a pipeline rank holds only its stages' pieces)."""
    pipeline = isinstance(model, nn.ModuleList)
    return {_clean(name, pipeline): p for name, p in model.named_parameters()}


def _targets(ours: str | None, cfg: ModelConfig) -> list[str]:
    """The parameters a tensor fills: with tied embeddings the embedding is also the head (a pipeline's last
    stage holds the head without the embedding), and a saved lm_head is ignored."""
    if ours is None or (cfg.tie_embeddings and ours == "output.weight"):
        return []
    if cfg.tie_embeddings and ours == "tok_embeddings.weight":
        return [ours, "output.weight"]
    return [ours]


def _copy_into(param: nn.Parameter, tensor: torch.Tensor, key: str, ours: str, path) -> None:
    if tuple(tensor.shape) != tuple(param.shape):
        raise HFWeightsError(f"checkpoint.init_from={path}: {key} has shape {list(tensor.shape)}, "
                             f"the model's {ours} is {list(param.shape)}")
    fill(param, lambda full: full.copy_(tensor))


@torch.no_grad()
def load_hf_weights(model: nn.Module, path: str | Path, cfg: ModelConfig) -> int:
    """Copy a Hugging Face folder's weights into this rank's parameters; returns how many were set.

    Every parameter of this rank must be found with the right shape, else an HFWeightsError names it.
    """
    from safetensors import safe_open

    # LoRA's adapters are not in a Hugging Face folder: they keep their init (B = 0, so the model starts as loaded).
    params = {name: p for name, p in local_parameters(model).items() if not is_adapter(name)}
    done: set[str] = set()
    experts = _ExpertStacks(params, cfg, path)
    known = {*expected_tensors(cfg), HEAD}  # the whole model's (a pipeline rank holds a part); a tied head: plan's
    for file in weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if key not in known and not key.endswith(BUFFER_SUFFIXES):
                    raise HFWeightsError(f"checkpoint.init_from={path}: tensor {key} is not part of the {cfg.family} "
                                         "model, so it would not be loaded; use a folder of that architecture")
                if experts.take(key, f):
                    continue
                targets = _targets(from_hf_name(key, cfg), cfg)
                targets = [t for t in targets if t in params and t not in done]
                if not targets:
                    continue  # another stage's tensor, a tied lm_head saved anyway, or a rotary buffer
                ours, tensor = from_hf(key, f.get_tensor(key), cfg)
                for target in targets:
                    _copy_into(params[target], tensor, key, target, path)
                    done.add(target)
    done |= experts.done
    missing = sorted(set(params) - done)
    if missing:
        raise HFWeightsError(f"checkpoint.init_from={path}: no weights for {', '.join(missing[:3])}"
                                f"{' and more' if len(missing) > 3 else ''}")
    return len(done)


class _ExpertStacks:
    """Per-expert Hub tensors gathered into this rank's stacked expert weights: a stack is filled once all of its
    experts are read (one layer's experts at a time in host memory, then each rank keeps its own slice)."""

    def __init__(self, params: dict[str, nn.Parameter], cfg: ModelConfig, path):
        self.params, self.cfg, self.path = params, cfg, path
        self.from_hf_expert = getattr(_spec(cfg), "from_hf_expert", None)
        self.pending: dict[str, dict[int, torch.Tensor]] = {}
        self.done: set[str] = set()

    def take(self, key: str, f) -> bool:
        """Whether `key` is a per-expert tensor (read into its stack when this rank holds it)."""
        found = self.from_hf_expert(key) if self.from_hf_expert is not None else None
        if found is None:
            return False
        ours, e = found
        if ours not in self.params:
            return True  # another pipeline stage's layer
        slots = self.pending.setdefault(ours, {})
        slots[e] = f.get_tensor(key).t()
        if len(slots) == self.cfg.moe.num_experts:
            _copy_into(self.params[ours], torch.stack([slots[i] for i in range(len(slots))]), key, ours, self.path)
            self.done.add(ours)
            del self.pending[ours]
        return True
