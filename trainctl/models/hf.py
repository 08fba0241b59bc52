"""Hugging Face Llama weights in and out: tensor names, the rotary layout, config.json, loading into any layout.

trainctl rotates interleaved pairs (x[2i], x[2i+1]) of each head (models/llama.py, as Meta's reference
code); transformers' Llama rotates halves (x[i], x[i + head_dim/2]). The attention outputs agree when
the rows of every q and k head are reordered: `to_hf_rows` and `from_hf_rows` (inverses of each other).

Loading (`load_hf_weights`) works in every layout the worker builds (one process, DDP, FSDP2, HSDP, TP,
pipeline stages): each rank reads one safetensors file at a time, one tensor at a time, and copies
into each parameter only its own slice (a DTensor's local shard); no rank ever holds the whole model.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from trainctl.config.hf_config import weight_files
from trainctl.config.schema import ModelConfig, head_dim_of
from trainctl.models.llama import _fill

# Segments that wrappers (DDP, torch.compile, activation checkpointing, FSDP1) add to parameter names.
WRAPPER_SEGMENTS = ("module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_BLOCK = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj",
          "attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj",
          "feed_forward.w3": "mlp.up_proj", "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm"}
_BLOCK_BACK = {theirs: ours for ours, theirs in _BLOCK.items()}
_TOP_BACK = {theirs: ours for ours, theirs in _TOP.items()}
_OURS = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")
_THEIRS = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
# The model_type and class of each family's config.json (what transformers' Auto classes dispatch on).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM"}
class HFWeightsError(Exception):
    """The folder's weights do not fit the model (one line, naming checkpoint.init_from)."""


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def to_hf_name(name: str) -> str:
    """`layers.3.attention.wq.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    if name in _TOP:
        return _TOP[name]
    match = _OURS.match(name)
    if not match or match.group(2) not in _BLOCK:
        raise KeyError(name)
    return f"model.layers.{match.group(1)}.{_BLOCK[match.group(2)]}.{match.group(3)}"


def from_hf_name(name: str) -> str | None:
    """The trainctl name of a Hugging Face Llama tensor; None for one trainctl has no use for (rotary buffers)."""
    if name in _TOP_BACK:
        return _TOP_BACK[name]
    match = _THEIRS.match(name)
    if match and match.group(2) in _BLOCK_BACK:
        return f"layers.{match.group(1)}.{_BLOCK_BACK[match.group(2)]}.{match.group(3)}"
    return None


def _heads_of(name: str, cfg: ModelConfig) -> int | None:
    """How many heads a tensor's rows hold when they need the rotary reordering: q's and k's weights and
    biases, and the q/k norms' weights (one head wide: they scale the rotated pairs elementwise)."""
    if name.endswith(("attention.wq.weight", "attention.wq.bias")):
        return cfg.n_heads
    if name.endswith(("attention.wk.weight", "attention.wk.bias")):
        return cfg.n_kv_heads
    if name.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
        return 1
    return None


def to_hf_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of each head from interleaved pairs (2i, 2i+1) to halves (i, i + head_dim/2)."""
    head_dim = w.shape[0] // heads
    return w.reshape(heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def from_hf_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of `to_hf_rows`."""
    head_dim = w.shape[0] // heads
    return w.reshape(heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(w.shape)


def to_hf(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> tuple[str, torch.Tensor]:
    heads = _heads_of(name, cfg)
    return to_hf_name(name), (to_hf_rows(tensor, heads) if heads else tensor).contiguous()


def from_hf(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> tuple[str | None, torch.Tensor]:
    ours = from_hf_name(name)
    heads = _heads_of(ours, cfg) if ours else None
    return ours, (from_hf_rows(tensor, heads) if heads else tensor)


def hf_config(cfg: ModelConfig, dtype: torch.dtype, eos_id: int | None = None, bos_id: int | None = None) -> dict:
    """config.json for transformers' LlamaForCausalLM: every field it needs to rebuild this model exactly."""
    data = {
        "architectures": [ARCHITECTURES[cfg.family]],
        "model_type": cfg.family,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": head_dim_of(cfg),
        "intermediate_size": cfg.ffn_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling_entry(cfg),
        "hidden_act": "silu",
        "attention_bias": cfg.qkv_bias,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "initializer_range": 0.02,
    }
    if cfg.family == "qwen2":  # Qwen2Config has no attention_bias: its q/k/v always carry biases
        data.pop("attention_bias")
    if cfg.family in ("qwen2", "qwen3", "mistral"):
        data.pop("mlp_bias")
        data["sliding_window"] = cfg.sliding_window or None
        data["use_sliding_window"] = False
    if eos_id is not None:
        data["eos_token_id"] = eos_id
    if bos_id is not None:
        data["bos_token_id"] = bos_id
    return data


def rope_scaling_entry(cfg: ModelConfig) -> dict | None:
    """config.json's rope_scaling as the published Llama 3.1/3.2 files write it (transformers reads it still)."""
    if cfg.rope_scaling == "linear":
        return {"rope_type": "linear", "factor": cfg.rope_factor}
    if cfg.rope_scaling == "llama3":
        return {"rope_type": "llama3", "factor": cfg.rope_factor, "low_freq_factor": cfg.rope_low_freq_factor,
                "high_freq_factor": cfg.rope_high_freq_factor,
                "original_max_position_embeddings": cfg.rope_original_max_seq_len}
    return None


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
    _fill(param, lambda full: full.copy_(tensor))


@torch.no_grad()
def load_hf_weights(model: nn.Module, path: str | Path, cfg: ModelConfig) -> int:
    """Copy a Hugging Face Llama folder's weights into this rank's parameters; returns how many were set.

    Every parameter of this rank must be found with the right shape, else an HFWeightsError names it.
    """
    from safetensors import safe_open

    params = local_parameters(model)
    done: set[str] = set()
    for file in weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                targets = _targets(from_hf_name(key), cfg)
                targets = [t for t in targets if t in params and t not in done]
                if not targets:
                    continue  # another stage's tensor, a tied lm_head saved anyway, or a rotary buffer
                ours, tensor = from_hf(key, f.get_tensor(key), cfg)
                for target in targets:
                    _copy_into(params[target], tensor, key, target, path)
                    done.add(target)
    missing = sorted(set(params) - done)
    if missing:
        raise HFWeightsError(f"checkpoint.init_from={path}: no weights for {', '.join(missing[:3])}"
                                f"{' and more' if len(missing) > 3 else ''}")
    return len(done)
