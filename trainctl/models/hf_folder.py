"""Writing a Hugging Face model folder from checkpoint tensors: the safetensors file(s) (sharded, with their
index, past a size), config.json, and the tokenizer the run trained with, checked against the run's record.

Kept apart from the reading of checkpoints (checkpoint_reader.py) and from the export's command and its
all-or-nothing output folder (export.py): this module only writes into a folder it is given.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from trainctl.config.load import load_run_config
from trainctl.config.schema import ModelConfig
from trainctl.core import checkpoints
from trainctl.models.checkpoint_reader import CONFIG_ERRORS, ExportError, read_tensors, tensor_bytes
from trainctl.models.hf import hf_config, to_hf_items

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def plan_shards(names: list[str], sizes: dict[str, int], max_shard_size: int) -> list[list[str]]:
    """Greedy split, in order, into shards of at most `max_shard_size` bytes (a bigger tensor gets its own)."""
    shards: list[list[str]] = [[]]
    filled = 0
    for name in names:
        if shards[-1] and filled + sizes[name] > max_shard_size:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += sizes[name]
    return shards


def shard_file(index: int, count: int) -> str:
    return SINGLE_FILE if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def _readable_like_other_files(path: Path) -> None:
    # safetensors creates its files 0600; inference tools often run as another user of a shared cluster.
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def write_weights(ckpt: Path, entries: dict, names: list[str], out: Path, max_shard_size: int,
                  cfg: ModelConfig, dtype: torch.dtype | None = None, read=None) -> int:
    """Write the safetensors file(s) in Hugging Face's names and rotary layout (and the index when sharded).

    Returns the total bytes. `dtype`: cast every tensor to it (default: as saved). `read(names)`: the tensors
    by name (default: as checkpointed; a LoRA --merged export folds the adapters in).
    """
    read = read or (lambda shard: read_tensors(ckpt, entries, shard))
    from safetensors.torch import save_file

    scale = (lambda item: dtype.itemsize / item.properties.dtype.itemsize) if dtype else (lambda item: 1)
    sizes = {n: int(tensor_bytes(entries[n][1]) * scale(entries[n][1])) for n in names}
    shards = plan_shards(names, sizes, max_shard_size)
    weight_map = {}
    for index, shard in enumerate(shards):
        filename = shard_file(index, len(shards))
        tensors = dict(item for name, t in read(shard).items()
                       for item in to_hf_items(name, t if dtype is None else t.to(dtype), cfg))
        save_file(tensors, str(out / filename), metadata={"format": "pt"})
        _readable_like_other_files(out / filename)
        weight_map.update(dict.fromkeys(tensors, filename))
    total = sum(sizes.values())
    if len(shards) > 1:
        index_data = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index_data, indent=2) + "\n")
    return total


def write_config(cfg: ModelConfig, ckpt: Path, out: Path, dtype: torch.dtype, tokens: dict | None) -> None:
    """config.json as transformers reads it, plus the run's own model config and where the weights came from."""
    eos = tokens.get("eos_id") if tokens else None
    data = {**hf_config(cfg, dtype, eos_id=eos), "trainctl_model": asdict(cfg),
            "trainctl_checkpoint": {"step": checkpoints.step_of(ckpt), "path": str(ckpt.resolve())}}
    (out / "config.json").write_text(json.dumps(data, indent=2) + "\n")


def write_tokenizer(tokens: dict | None, cfg: ModelConfig, out: Path) -> None:
    """The tokenizer the run trained with (a Hugging Face tokenizer.json), as AutoTokenizer loads it: the run's
    own copies when it recorded them (a tokenizer_config.json from a Hugging Face folder kept as it was), else
    the dataset's file with a tokenizer_config.json written here."""
    if not tokens or not tokens.get("file"):
        return
    for name, source in tokens.get("files", {"tokenizer.json": tokens["file"]}).items():
        shutil.copyfile(source, out / name)
    if (out / "tokenizer_config.json").exists():
        return
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_seq_len,
                "eos_token": tokens.get("eos_token"), "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")


def run_tokenizer(run_dir: Path) -> dict | None:
    """The tokenizer the run recorded at its start (RUN/tokenizer/, each file's sha256 checked): {file, files,
    eos_id, eos_token}; for a run made before trainctl kept that record, the dataset's (with a warning)."""
    from trainctl.core import rundir as layout

    record_path = run_dir / layout.TOKENIZER_RECORD
    if not record_path.exists() and (run_dir / layout.TOKENIZER).exists():
        # The run kept copies but lost their record: guessing (the dataset's file, or none) could bundle a
        # tokenizer the model never saw.
        raise ExportError(f"{record_path}: missing, so the tokenizer copies beside it cannot be vouched for; restore "
                          f"it from a backup of the run, or move {run_dir / layout.TOKENIZER} aside to export with "
                          "the dataset's tokenizer")
    if not record_path.exists():
        tokens = data_tokenizer(run_dir)
        if tokens and tokens.get("file"):
            print(f"warning: {run_dir} keeps no copy of its tokenizer (made before trainctl recorded it); "
                  f"bundling {tokens['file']}, which may have changed since", file=sys.stderr)
        return tokens
    record = layout.read_json(record_path)
    digests = record.get("files")
    if not isinstance(digests, dict):
        raise ExportError(f"{record_path}: damaged (no files); the run's tokenizer cannot be vouched for")
    files = {}
    for name, digest in digests.items():
        path = run_dir / layout.TOKENIZER / str(name)
        data = layout.read_bytes(path, 1 << 30)
        if data is None or hashlib.sha256(data).hexdigest() != digest:
            source = record.get("sources", {}).get(name, "its source")
            raise ExportError(f"{path}: missing or changed since the run started (sha256 differs from "
                              f"{record_path.name}); restore it from {source}")
        files[str(name)] = path
    if "tokenizer.json" not in files:
        return {"eos_id": record.get("eos_id"), "file": None, "eos_token": None}
    from trainctl.data.tokenizer import token_string

    eos_id = record.get("eos_id")
    eos_token = token_string(str(files["tokenizer.json"]), eos_id) if isinstance(eos_id, int) else None
    return {"eos_id": eos_id, "file": str(files["tokenizer.json"]), "files": files, "eos_token": eos_token}


def data_tokenizer(run_dir: Path) -> dict | None:
    """The run's data tokenizer from its prepared dataset's meta.json: {file, eos_id, eos_token}, or None."""
    try:
        data = load_run_config(run_dir).data
    except CONFIG_ERRORS:
        return None
    if data.kind != "memmap" or not data.datasets:
        return None
    from trainctl.data import format as dataset
    from trainctl.data.tokenizer import token_string

    try:
        meta = dataset.read_meta(data.datasets[0])
    except dataset.DatasetError:
        return None
    tok = meta.tokenizer
    info = {"eos_id": tok.eos_id, "file": None, "eos_token": None}
    if tok.file:
        info["file"] = str(meta.root / tok.file)
        info["eos_token"] = token_string(info["file"], tok.eos_id)
    return info
