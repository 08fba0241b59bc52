"""A Hugging Face Llama directory's shape, read from its config.json without torch.

`model=hf model.path=DIR` takes the model's shape from DIR/config.json; `checkpoint.init_from=DIR`
loads DIR's safetensors weights into it in the worker. Both are checked here on the login node:
a config.json that is not a Llama trainctl can run exactly (biases, rope scaling, another
activation, a head size other than dim / heads) is refused in one line, as are missing weights.
"""

from __future__ import annotations

import json
from pathlib import Path

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Fields of HF's LlamaConfig and the ModelConfig field each one fills.
FIELDS = {
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "intermediate_size": "ffn_dim",
    "vocab_size": "vocab_size",
    "max_position_embeddings": "max_seq_len",
}


class HFConfigError(ValueError):
    """One line: what is wrong with the directory and what would work."""


def read_config(path: str | Path) -> dict:
    """DIR/config.json as a dict; an HFConfigError when it is missing or not JSON."""
    where = Path(path).expanduser()
    if not where.is_dir():
        raise HFConfigError(f"{path}: not a directory; point it at a Hugging Face Llama folder "
                            f"(config.json and *.safetensors)")
    try:
        data = json.loads((where / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise HFConfigError(f"{path}: no {CONFIG_FILE}; a Hugging Face model folder holds config.json "
                            "and model*.safetensors (save_pretrained writes both)") from None
    except (OSError, ValueError) as exc:
        raise HFConfigError(f"{where / CONFIG_FILE}: cannot be read as JSON ({exc})") from None
    if not isinstance(data, dict):
        raise HFConfigError(f"{where / CONFIG_FILE}: not a JSON object")
    return data


def model_fields(path: str | Path) -> dict:
    """ModelConfig fields for the Llama at `path`; HFConfigError when trainctl cannot run it exactly."""
    data = read_config(path)
    where = Path(path).expanduser() / CONFIG_FILE
    if data.get("model_type") != "llama":
        raise HFConfigError(f"{where}: model_type={data.get('model_type')!r}; only Llama (model_type: llama) "
                            "checkpoints load into trainctl's decoder")
    missing = [key for key in FIELDS if not isinstance(data.get(key), int)]
    if missing:
        raise HFConfigError(f"{where}: no integer {', '.join(missing)}")
    fields = {ours: data[theirs] for theirs, ours in FIELDS.items()}
    fields["n_kv_heads"] = int(data.get("num_key_value_heads") or fields["n_heads"])
    fields["norm_eps"] = float(data.get("rms_norm_eps", 1e-6))
    fields["rope_theta"] = float(_rope_theta(data))
    fields["tie_embeddings"] = bool(data.get("tie_word_embeddings", False))
    problems = _unsupported(data, fields)
    if problems:
        raise HFConfigError(f"{where}: {problems[0]}; trainctl's decoder cannot reproduce it")
    return fields


def _rope_theta(data: dict) -> float:
    params = data.get("rope_parameters") or {}  # transformers >= 5 keeps theta there
    return params.get("rope_theta", data.get("rope_theta", 10000.0))


def _unsupported(data: dict, fields: dict) -> list[str]:
    problems = []
    scaling = data.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type")) or (data.get("rope_parameters") or {}).get("rope_type")
    if kind not in (None, "default"):
        problems.append(f"rope scaling {kind!r} is not implemented (only plain RoPE)")
    for key in ("attention_bias", "mlp_bias"):
        if data.get(key):
            problems.append(f"{key}=true (trainctl's linear layers have no bias)")
    if data.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={data['hidden_act']!r} (trainctl's MLP is SwiGLU with silu)")
    head_dim = data.get("head_dim")
    if head_dim is not None and fields["n_heads"] and head_dim * fields["n_heads"] != fields["dim"]:
        problems.append(f"head_dim={head_dim} is not hidden_size / num_attention_heads")
    return problems


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a Hugging Face folder (the index's, or the single file); HFConfigError if none."""
    where = Path(path).expanduser()
    index = where / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise HFConfigError(f"{index}: not a safetensors index ({exc})") from None
        files = [where / name for name in sorted(set(weight_map.values()))]
    elif (where / SINGLE_FILE).is_file():
        files = [where / SINGLE_FILE]
    else:
        raise HFConfigError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE}; save the model with "
                            "save_pretrained(..., safe_serialization=True)")
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        raise HFConfigError(f"{path}: the index names {absent[0]}, which is missing")
    return files
