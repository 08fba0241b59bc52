"""Export a checkpoint's model weights as safetensors for inference tools.

    python -m trainctl.models.export RUN_DIR [--checkpoint PATH] [--out DIR] [--max-shard-size BYTES]

Reads only the model tensors ("model.<fqn>" in the DCP metadata; never the optimizer
state) of a torch.distributed.checkpoint directory, in one process without a process
group; DCP reassembles tensors that FSDP/TP ranks saved in pieces. Tensors are read one
output shard at a time, so peak memory is about one shard, not the whole model.

Writes `model.safetensors`, or when the total exceeds the shard size,
`model-0000K-of-0000N.safetensors` plus `model.safetensors.index.json` (Hugging Face's
layout), and `config.json`: the run's ModelConfig fields plus `trainctl_checkpoint`.
Names are trainctl's own (`layers.0.attention.wq.weight`), dtypes those of the
checkpoint. Tied embeddings are saved once, as `tok_embeddings.weight`.

The export is written to a temporary sibling folder and renamed into place, so a
folder at the output path is always complete; an existing non-empty one is refused.
User errors (not a run directory, no checkpoint, a bad path) print one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from trainctl.config.schema import ModelConfig, load_run_config
from trainctl.models.llama import build_model

STEP_DIR = re.compile(r"step-(\d{8,})")  # as trainctl.train.checkpoint names them; matched whole
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # Hugging Face's save_pretrained default ("5GB")
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
# Module wrappers (torch.compile, activation checkpointing, FSDP1) that may prefix saved names.
WRAPPER_SEGMENTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class ExportError(Exception):
    """A problem the user can fix; the message is one line."""


def parse_size(text: str) -> int:
    """Bytes from "5000000", "500MB" or "2GiB" (decimal KB/MB/GB as Hugging Face counts them)."""
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if unit not in SIZE_UNITS or int(match.group(1)) <= 0:
        raise ExportError(f"--max-shard-size={text}: expected a positive number of bytes, e.g. 5000000000 or 5GB")
    return int(match.group(1)) * SIZE_UNITS[unit]


def committed_checkpoints(run_dir: Path) -> list[Path]:
    """The run's committed checkpoints (step-NNNNNNNN with DCP metadata; no .tmp), oldest first.

    The checkpoint manager renames step-N.tmp to step-N only after writing its manifest, so
    the name alone marks a commit; DCP's .metadata is what this reader needs.
    """
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.fullmatch(p.name) and (p / ".metadata").is_file()]
    return sorted(found, key=lambda p: int(STEP_DIR.fullmatch(p.name).group(1)))


def find_checkpoint(run_dir: Path, checkpoint: str | None) -> Path:
    """The checkpoint to export: `checkpoint` (a path, or a name under RUN_DIR/checkpoints), else the newest."""
    if checkpoint is None:
        found = committed_checkpoints(run_dir)
        if not found:
            raise ExportError(f"{run_dir}: no committed checkpoint under {run_dir / 'checkpoints'}; train with checkpoint.save_final=true or checkpoint.every=N")
        return found[-1]
    path = Path(checkpoint)
    if not path.exists() and (run_dir / "checkpoints" / checkpoint).exists():
        path = run_dir / "checkpoints" / checkpoint
    if not path.is_dir():
        raise ExportError(f"--checkpoint {checkpoint}: no such checkpoint directory")
    if path.name.endswith(".tmp"):
        raise ExportError(f"--checkpoint {checkpoint}: an uncommitted checkpoint (.tmp: still being written, or a save that died)")
    if not (path / ".metadata").is_file():
        raise ExportError(f"--checkpoint {checkpoint}: not a committed DCP checkpoint (no .metadata in it)")
    return path


def checkpoint_step(ckpt: Path) -> int | None:
    """The optimizer step of a checkpoint: from its name, else from its meta.json."""
    match = STEP_DIR.fullmatch(ckpt.name)
    if match:
        return int(match.group(1))
    try:
        return int(json.loads((ckpt / "meta.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_model_config(run_dir: Path) -> ModelConfig:
    """The run's ModelConfig, from RUN_DIR/config.yaml."""
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: no such run directory")
    if not (run_dir / "config.yaml").is_file():
        raise ExportError(f"{run_dir}: not a run directory (no config.yaml in it)")
    try:
        return load_run_config(run_dir).model
    except Exception as exc:  # YAML or schema errors of a user's file: report them, no traceback
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExportError(f"{run_dir / 'config.yaml'}: cannot be read as a run config: {first_line}") from exc


def _clean_name(fqn: str) -> str:
    return ".".join(part for part in fqn.split(".") if part not in WRAPPER_SEGMENTS)


def model_entries(ckpt: Path) -> dict[str, tuple[str, TensorStorageMetadata]]:
    """Every model tensor of the checkpoint: export name -> (DCP key, its metadata)."""
    metadata = FileSystemReader(str(ckpt)).read_metadata()
    planner_data = metadata.planner_data or {}
    entries = {}
    for key, item in metadata.state_dict_metadata.items():
        # planner_data maps each flat key to its path in the nested dict: ("model", fqn).
        path = planner_data.get(key) or tuple(key.split(".", 1))
        if len(path) == 2 and path[0] == "model" and isinstance(item, TensorStorageMetadata):
            entries[_clean_name(str(path[1]))] = (key, item)
    if not entries:
        raise ExportError(f"{ckpt}: the checkpoint holds no model tensors (no 'model.*' keys)")
    return entries


def check_against_config(entries: dict, cfg: ModelConfig, ckpt: Path) -> list[str]:
    """Names to export, in the model's order; fails when the checkpoint does not match the run's model config."""
    expected = {name: tuple(t.shape) for name, t in build_model(cfg, device="meta").state_dict().items()}
    if cfg.tie_embeddings:
        expected.pop("output.weight")  # the same tensor as tok_embeddings.weight: saved once
        entries.pop("output.weight", None)
    problems = [f"missing {n}" for n in expected if n not in entries]
    problems += [f"unexpected {n}" for n in entries if n not in expected]
    problems += [f"{n} has shape {list(entries[n][1].size)}, the config says {list(s)}" for n, s in expected.items() if n in entries and tuple(entries[n][1].size) != s]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ExportError(f"{ckpt}: the checkpoint does not match the run's model config: {'; '.join(problems[:3])}{more}")
    return list(expected)


def tensor_bytes(item: TensorStorageMetadata) -> int:
    return item.size.numel() * item.properties.dtype.itemsize


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


def read_tensors(ckpt: Path, entries: dict[str, tuple[str, TensorStorageMetadata]], names: list[str]) -> dict[str, torch.Tensor]:
    """Read the named tensors, whole, into CPU memory (DCP fills preallocated tensors by flat key)."""
    state = {entries[n][0]: torch.empty(entries[n][1].size, dtype=entries[n][1].properties.dtype) for n in names}
    with warnings.catch_warnings():
        # Loading in one process without a process group is exactly the intent here.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    return {n: state[entries[n][0]] for n in names}


def shard_file(index: int, count: int) -> str:
    return SINGLE_FILE if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def _readable_like_other_files(path: Path) -> None:
    # safetensors creates its files 0600; inference tools often run as another user of a shared cluster.
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def write_weights(ckpt: Path, entries: dict, names: list[str], out: Path, max_shard_size: int) -> int:
    """Write the safetensors file(s) (and the index when sharded); returns the total bytes."""
    from safetensors.torch import save_file

    sizes = {n: tensor_bytes(entries[n][1]) for n in names}
    shards = plan_shards(names, sizes, max_shard_size)
    weight_map = {}
    for index, shard in enumerate(shards):
        filename = shard_file(index, len(shards))
        save_file(read_tensors(ckpt, entries, shard), str(out / filename), metadata={"format": "pt"})
        _readable_like_other_files(out / filename)
        weight_map.update(dict.fromkeys(shard, filename))
    total = sum(sizes.values())
    if len(shards) > 1:
        index_data = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index_data, indent=2) + "\n")
    return total


def write_config(cfg: ModelConfig, ckpt: Path, out: Path) -> None:
    """config.json: the ModelConfig fields and where the weights came from."""
    data = {**asdict(cfg), "trainctl_checkpoint": {"step": checkpoint_step(ckpt), "path": str(ckpt.resolve())}}
    (out / "config.json").write_text(json.dumps(data, indent=2) + "\n")


def default_out(run_dir: Path, ckpt: Path) -> Path:
    return run_dir / "export" / ckpt.name


def prepare_out(out: Path) -> Path:
    """A fresh temporary folder next to `out`; refuses an `out` that already holds files."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out}: already exists and is not empty; remove it or pass --out DIR")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def export(run_dir: Path, checkpoint: str | None = None, out: Path | None = None, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """Export one checkpoint of `run_dir` (default: the newest); returns the output folder."""
    cfg = read_model_config(run_dir)
    ckpt = find_checkpoint(run_dir, checkpoint)
    entries = model_entries(ckpt)
    names = check_against_config(entries, cfg, ckpt)
    out = out or default_out(run_dir, ckpt)
    tmp = prepare_out(out)
    try:
        write_weights(ckpt, entries, names, tmp, max_shard_size)
        write_config(cfg, ckpt, tmp)
        if out.is_dir():
            out.rmdir()  # empty (checked above); rename needs the name free
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainctl.models.export", description="Export a checkpoint's model as safetensors.")
    parser.add_argument("run_dir", type=Path, help="the run directory (holds config.yaml and checkpoints/)")
    parser.add_argument("--checkpoint", help="a checkpoint directory, or its name under RUN_DIR/checkpoints (default: the newest committed)")
    parser.add_argument("--out", type=Path, help="output folder (default: RUN_DIR/export/step-NNNNNNNN)")
    parser.add_argument("--max-shard-size", default=str(DEFAULT_MAX_SHARD_SIZE), help="bytes per file before sharding (5000000000, 500MB, 2GiB)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: 0 on success, 2 with one line on stderr for a user error."""
    args = parse_args(argv)
    try:
        out = export(args.run_dir, args.checkpoint, args.out, parse_size(args.max_shard_size))
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    files = sorted(p.name for p in out.iterdir())
    step = json.loads((out / "config.json").read_text())["trainctl_checkpoint"]["step"]
    print(f"exported step {step} to {out}: {', '.join(files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
