"""A Hugging Face Llama directory's shape, read from its config.json without torch.

`model=hf model.path=DIR` takes the model's shape from DIR/config.json; `checkpoint.init_from=DIR`
loads DIR's safetensors weights into it in the worker. Both are checked here on the login node:
a config.json that is not a Llama trainctl can run exactly (biases, RoPE scaling but linear or llama3, another
activation, a head size other than dim / heads) is refused in one line, as are missing weights.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

from trainctl.core.rundir import open_regular, read_bytes

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FAMILIES = ("llama", "qwen2", "qwen3", "mistral")  # HF model_type values (schema.FAMILIES)
# Fields of HF's LlamaConfig (and Qwen2/Qwen3/Mistral's) and the ModelConfig field each one fills.
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


MAX_CONFIG_BYTES = 4 << 20  # a config.json is a few KB; a larger one is not a model's


def read_config(path: str | Path) -> dict:
    """DIR/config.json as a dict; an HFConfigError when it is missing, not a regular file, too large, or not a
    JSON object."""
    where = Path(path).expanduser()
    if not where.is_dir():
        raise HFConfigError(f"{path}: not a directory; point it at a Hugging Face Llama folder "
                            f"(config.json and *.safetensors)")
    file = where / CONFIG_FILE
    if not file.exists():
        raise HFConfigError(f"{path}: no {CONFIG_FILE}; a Hugging Face model folder holds config.json "
                            "and model*.safetensors (save_pretrained writes both)")
    raw = read_bytes(file, MAX_CONFIG_BYTES)  # never opens a FIFO or a device, never reads without a bound
    if raw is None:
        raise HFConfigError(f"{file}: not a regular file of at most {MAX_CONFIG_BYTES >> 20} MiB; "
                            "save_pretrained writes a small JSON file")
    try:
        data = json.loads(raw)  # NaN and Infinity parse: the typed checks below name the key that holds one
    except (ValueError, RecursionError) as exc:
        raise HFConfigError(f"{file}: cannot be read as JSON ({str(exc).splitlines()[0] if str(exc) else exc!r})") \
            from None
    if not isinstance(data, dict):
        raise HFConfigError(f"{file}: not a JSON object")
    return data


def model_fields(path: str | Path) -> dict:
    """ModelConfig fields for the Llama at `path`; HFConfigError when trainctl cannot run it exactly.

    Every field is checked for its type before use: a size is a positive integer (not a bool, a float or a
    string), a float is finite and positive, a flag is a bool; nothing is coerced.
    """
    data = read_config(path)
    where = Path(path).expanduser() / CONFIG_FILE
    family = data.get("model_type")
    if family not in FAMILIES:
        raise HFConfigError(f"{where}: model_type={_shown(family)}; trainctl's decoder loads model_type "
                            f"{', '.join(FAMILIES)} (Llama 2/3/3.1/3.2, Qwen 2.5, Qwen3, Mistral)")
    fields = {ours: _size(where, data, theirs) for theirs, ours in FIELDS.items()}
    kv = data.get("num_key_value_heads")
    fields["n_kv_heads"] = fields["n_heads"] if kv is None else _size(where, data, "num_key_value_heads")
    if fields["n_heads"] % fields["n_kv_heads"]:
        raise HFConfigError(f"{where}: num_key_value_heads={fields['n_kv_heads']} does not divide "
                            f"num_attention_heads={fields['n_heads']}")
    fields["norm_eps"] = _positive_float(where, "rms_norm_eps", data.get("rms_norm_eps", 1e-6))
    params = _mapping(where, data, "rope_parameters")  # transformers >= 5 keeps theta there
    theta = params.get("rope_theta", data.get("rope_theta", 10000.0))
    fields["rope_theta"] = _positive_float(where, "rope_theta", theta)
    fields.update(rope_scaling_fields(where, data))
    tie = data.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise HFConfigError(f"{where}: tie_word_embeddings={_shown(tie)}: must be true or false")
    fields["tie_embeddings"] = tie
    fields.update(family_fields(where, data, fields))
    problems = _unsupported(where, data, fields)
    if problems:
        raise HFConfigError(f"{where}: {problems[0]}; trainctl's decoder cannot reproduce it")
    return fields


def family_fields(where: Path, data: dict, fields: dict) -> dict:
    """What sets a family apart: Qwen 2.5's q/k/v biases, Qwen3's q/k norms and head_dim, a sliding window."""
    family = data["model_type"]
    out = {"family": family, "qkv_bias": family == "qwen2", "qk_norm": family == "qwen3"}
    head_dim = data.get("head_dim")
    if head_dim is not None:
        head_dim = _size(where, data, "head_dim")
        out["head_dim"] = 0 if head_dim * fields["n_heads"] == fields["dim"] else head_dim
    # Qwen's configs name a window but use it only with use_sliding_window: true; Mistral's always use theirs.
    window = data.get("sliding_window")
    used = data.get("use_sliding_window", True) if family != "mistral" else True
    if window is not None and used:
        out["sliding_window"] = _size(where, data, "sliding_window")
    return out


def rope_scaling_fields(where: Path, data: dict) -> dict:
    """ModelConfig's rope_* fields from rope_scaling (transformers < 5, the published files) or rope_parameters.

    Only scalings trainctl reproduces exactly are taken: default, linear and llama3 (whose attention factor is 1);
    yarn, dynamic, longrope and the rest are refused by name.
    """
    scaling = _mapping(where, data, "rope_scaling") or _mapping(where, data, "rope_parameters")
    key = "rope_scaling" if data.get("rope_scaling") is not None else "rope_parameters"
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind is None and set(scaling) - {"rope_theta"}:  # a factor with no kind: refused, never guessed
        raise HFConfigError(f"{where}: {key}={_shown(scaling)}: no rope_type; name it (default, linear or llama3)")
    if kind in (None, "default"):
        return {"rope_scaling": "none"}
    if kind not in ("linear", "llama3"):
        raise HFConfigError(f"{where}: {key}.rope_type={_shown(kind)}: not implemented; trainctl reproduces default, "
                            "linear and llama3 RoPE")
    fields = {"rope_scaling": kind, "rope_factor": _positive_float(where, f"{key}.factor", scaling.get("factor"))}
    if kind == "llama3":
        fields["rope_low_freq_factor"] = _positive_float(where, f"{key}.low_freq_factor",
                                                         scaling.get("low_freq_factor"))
        fields["rope_high_freq_factor"] = _positive_float(where, f"{key}.high_freq_factor",
                                                          scaling.get("high_freq_factor"))
        fields["rope_original_max_seq_len"] = _size(where, scaling, "original_max_position_embeddings")
        if fields["rope_high_freq_factor"] <= fields["rope_low_freq_factor"]:
            raise HFConfigError(f"{where}: {key}.high_freq_factor must be greater than low_freq_factor")
    return fields


def _shown(value) -> str:
    text = repr(value) if isinstance(value, str | float) else json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _size(where: Path, data: dict, key: str) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        what = "missing" if key not in data else f"{key}={_shown(value)}"
        raise HFConfigError(f"{where}: {what}: {key} must be a positive integer")
    return value


def _positive_float(where: Path, key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise HFConfigError(f"{where}: {key}={_shown(value)}: must be a positive finite number")
    return float(value)


def _mapping(where: Path, data: dict, key: str) -> dict:
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise HFConfigError(f"{where}: {key}={_shown(value)}: must be a JSON object or null")
    return value


def _unsupported(where: Path, data: dict, fields: dict) -> list[str]:
    problems = []
    attention_factor = (_mapping(where, data, "rope_scaling") or _mapping(where, data, "rope_parameters")).get(
        "attention_factor")
    if attention_factor not in (None, 1, 1.0):
        problems.append(f"rope attention_factor={_shown(attention_factor)} (trainctl's RoPE does not scale attention)")
    for key in ("attention_bias", "mlp_bias"):
        if data.get(key) not in (None, False):
            problems.append(f"{key}={_shown(data[key])} (trainctl's output and MLP projections have no bias)")
    act = data.get("hidden_act", "silu")
    if act != "silu":
        problems.append(f"hidden_act={_shown(act)} (trainctl's MLP is SwiGLU with silu)")
    if not fields.get("head_dim") and fields["dim"] % fields["n_heads"]:
        problems.append(f"hidden_size={fields['dim']} is not a multiple of num_attention_heads={fields['n_heads']} "
                        "and head_dim is not given")
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


# safetensors dtypes the worker can load into a float model; integer ones are quantized or not weights at all
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header


def check_weight_headers(files: list[Path]) -> None:
    """Read each safetensors file's header (bounded; never a FIFO) and refuse, in one line, a header that is not
    safetensors, tensors stored as integers, or offsets past the end of the file (a truncated download)."""
    for file in files:
        f = open_regular(file)
        if f is None:
            raise HFConfigError(f"{file}: not a regular file")
        with f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            if length is None or length > min(MAX_HEADER_BYTES, size - 8):
                raise HFConfigError(f"{file}: not a safetensors file (its header length {length} does not fit in "
                                    f"its {size} bytes); download or save it again")
            try:
                header = json.loads(f.read(length))
            except (ValueError, RecursionError):
                raise HFConfigError(f"{file}: its safetensors header is not JSON; download or save it again") from None
        _check_entries(file, header, size - 8 - length)


def _check_entries(file: Path, header, data_bytes: int) -> None:
    if not isinstance(header, dict):
        raise HFConfigError(f"{file}: its safetensors header is not a JSON object; download or save it again")
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("data_offsets"), list):
            raise HFConfigError(f"{file}: tensor {name!r} has no data offsets; download or save it again")
        dtype = entry.get("dtype")
        if dtype not in FLOAT_DTYPES:
            raise HFConfigError(f"{file}: tensor {name!r} is stored as {dtype!r}; trainctl trains float weights "
                                "(F32, BF16, F16): use the unquantized checkpoint")
        end = entry["data_offsets"][-1] if entry["data_offsets"] else None
        if not isinstance(end, int) or end > data_bytes:
            raise HFConfigError(f"{file}: tensor {name!r} ends at byte {end}, past the file's {data_bytes} data bytes "
                                "(a truncated file?); download or save it again")
