"""Export a checkpoint's model weights as safetensors for inference tools.

    python -m trainctl.models.export RUN_DIR [--checkpoint PATH] [--out DIR] [--max-shard-size BYTES] [--dtype bf16]

Reads only the model tensors ("model.<fqn>" in the DCP metadata; never the optimizer
state) of a torch.distributed.checkpoint directory, in one process without a process
group; DCP reassembles tensors that FSDP/TP ranks saved in pieces. Tensors are read one
output shard at a time, so peak memory is about one shard, not the whole model.

Writes `model.safetensors`, or when the total exceeds the shard size,
`model-0000K-of-0000N.safetensors` plus `model.safetensors.index.json` (Hugging Face's
layout), and `config.json` as the family's transformers class reads it (plus `trainctl_model` and
`trainctl_checkpoint`). Names and the q/k rotary layout are Hugging Face's (models/hf.py), dtypes
those of the checkpoint unless --dtype casts them. Tied embeddings are saved once, as
`model.embed_tokens.weight`. When the run trained on a dataset prepared with a Hugging Face
tokenizer, its tokenizer.json (and a tokenizer_config.json) come along.

Only a verified checkpoint is read (trainctl.core.checkpoints: committed, and every file matches
its manifest): a named one that fails is refused; by default the newest valid one is taken and each
newer one skipped is named on stderr, with why.

The export is written to a temporary sibling folder and renamed into place, so a
folder at the output path is always complete; an existing non-empty one is refused.
Every failure the user can act on (not a run directory, no valid checkpoint, a checkpoint DCP
cannot read, an output path that cannot be written) prints one line, exits 2, and leaves nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import pickle
import re
import shutil
import sys
import warnings
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import yaml
from omegaconf.errors import OmegaConfBaseException
from safetensors import SafetensorError
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from trainctl.config.load import load_run_config
from trainctl.config.schema import ModelConfig
from trainctl.core import checkpoints, rundir
from trainctl.core.errors import UserError
from trainctl.models import lora_export
from trainctl.models.build import build_model
from trainctl.models.hf import hf_config, to_hf
from trainctl.models.verify import VerifyError, verify_export

DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # Hugging Face's save_pretrained default ("5GB")
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
# Module wrappers (torch.compile, activation checkpointing, FSDP1) that may prefix saved names.
WRAPPER_SEGMENTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DCP_METADATA = ".metadata"
EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# pickle documents no common base for what a damaged file raises ("including but not limited to" these).
PICKLE_ERRORS = (
    pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError, KeyError, TypeError, ValueError
)
# A config.yaml that does not load: YAML's and OmegaConf's errors share no base (OmegaConf's are mostly ValueError).
CONFIG_ERRORS = (OSError, ValueError, TypeError, KeyError, yaml.YAMLError, OmegaConfBaseException)


class ExportError(UserError):
    """A problem the user can fix; the message is one line."""


def parse_size(text: str) -> int:
    """Bytes from "5000000", "500MB" or "2GiB" (decimal KB/MB/GB as Hugging Face counts them)."""
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if unit not in SIZE_UNITS or int(match.group(1)) <= 0:
        raise ExportError(f"--max-shard-size={text}: expected a positive number of bytes, e.g. 5000000000 or 5GB")
    return int(match.group(1)) * SIZE_UNITS[unit]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _more(problems: list[str]) -> str:
    return f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""


def _why_not_committed(path: Path) -> str:
    if path.name.endswith(checkpoints.TMP_SUFFIX):
        return "an uncommitted checkpoint (.tmp: still being written, or a save that died)"
    if checkpoints.step_of(path) is None:
        return "not a committed checkpoint (a committed one is named step-NNNNNNNN)"
    return f"not a committed checkpoint (no {checkpoints.MANIFEST} in it: a save that died before its commit)"


def named_checkpoint(run_dir: Path, checkpoint: str) -> Path:
    """`checkpoint` (a path, or a name under RUN_DIR/checkpoints) if it is committed and verifies; else refused."""
    path = Path(checkpoint)
    if not path.exists() and (checkpoints.checkpoint_dir(run_dir) / checkpoint).exists():
        path = checkpoints.checkpoint_dir(run_dir) / checkpoint
    if not path.is_dir():
        raise ExportError(f"--checkpoint {checkpoint}: no such checkpoint directory")
    if path.name not in {p.name for _, p in checkpoints.list_committed(path.parent)}:
        raise ExportError(f"--checkpoint {checkpoint}: {_why_not_committed(path)}")
    problems = checkpoints.verify(path)
    if problems:
        raise ExportError(
            f"--checkpoint {checkpoint}: fails verification: {problems[0]}{_more(problems)}; "
            "name another, or leave --checkpoint out to export the newest valid one"
        )
    return path


def newest_valid_checkpoint(run_dir: Path) -> Path:
    """The newest committed checkpoint that verifies; each newer one skipped is named on stderr, with why."""
    choice = checkpoints.newest_valid(run_dir)
    skipped = [f"{path.name}: {problem}" for path, problem in choice.skipped]
    root = checkpoints.checkpoint_dir(run_dir)
    if choice.path is None and not skipped:
        raise ExportError(
            f"{run_dir}: no committed checkpoint under {root} (step-NNNNNNNN with {checkpoints.MANIFEST}); "
            "train with checkpoint.save_final=true or checkpoint.every=N"
        )
    if choice.path is None:
        more = f" (and {len(skipped) - 3} more)" if len(skipped) > 3 else ""
        raise ExportError(f"{run_dir}: no committed checkpoint verifies: {'; '.join(skipped[:3])}{more}")
    for line in skipped:
        print(f"warning: skipped {line}", file=sys.stderr)
    return choice.path


def find_checkpoint(run_dir: Path, checkpoint: str | None) -> Path:
    """The checkpoint to export: `checkpoint` if given (it must verify), else the newest valid one."""
    return newest_valid_checkpoint(run_dir) if checkpoint is None else named_checkpoint(run_dir, checkpoint)


def read_model_config(run_dir: Path) -> ModelConfig:
    """The run's ModelConfig, from RUN_DIR/config.yaml."""
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: no such run directory")
    if not (run_dir / rundir.CONFIG).is_file():
        raise ExportError(f"{run_dir}: not a run directory (no {rundir.CONFIG} in it)")
    try:
        return load_run_config(run_dir).model
    except CONFIG_ERRORS as exc:  # a user's damaged or hand-edited file: report it, no traceback
        raise ExportError(f"{run_dir / rundir.CONFIG}: cannot be read as a run config: {_first_line(exc)}") from None


def read_metadata(ckpt: Path) -> Metadata:
    """The checkpoint's DCP metadata; a damaged or foreign `.metadata` is a user error naming it."""
    try:
        metadata = FileSystemReader(str(ckpt)).read_metadata()
    except OSError as exc:
        raise ExportError(f"{ckpt / DCP_METADATA}: unreadable ({exc.strerror or exc})") from None
    except PICKLE_ERRORS as exc:
        raise ExportError(f"{ckpt / DCP_METADATA}: not DCP checkpoint metadata ({_first_line(exc)})") from None
    if not isinstance(metadata, Metadata):
        raise ExportError(f"{ckpt / DCP_METADATA}: not DCP checkpoint metadata (a pickled {type(metadata).__name__})")
    return metadata


def _clean_name(fqn: str) -> str:
    return ".".join(part for part in fqn.split(".") if part not in WRAPPER_SEGMENTS)


def model_entries(ckpt: Path) -> dict[str, tuple[str, TensorStorageMetadata]]:
    """Every model tensor of the checkpoint: export name -> (DCP key, its metadata)."""
    metadata = read_metadata(ckpt)
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
    problems += [f"{n} has shape {list(entries[n][1].size)}, the config says {list(shape)}"
                 for n, shape in expected.items() if n in entries and tuple(entries[n][1].size) != shape]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ExportError(f"{ckpt}: the checkpoint does not match the run's model config: "
                          f"{'; '.join(problems[:3])}{more}")
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


def read_tensors(
    ckpt: Path, entries: dict[str, tuple[str, TensorStorageMetadata]], names: list[str]
) -> dict[str, torch.Tensor]:
    """Read the named tensors, whole, into CPU memory (DCP fills preallocated tensors by flat key)."""
    state = {entries[n][0]: torch.empty(entries[n][1].size, dtype=entries[n][1].properties.dtype) for n in names}
    with warnings.catch_warnings():
        # Loading in one process without a process group is exactly the intent here.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
        except CheckpointException as exc:  # DCP wraps whatever a shard read raised, per rank
            reason = _dcp_failure(exc)
            raise ExportError(f"{ckpt}: DCP cannot read it: {reason}; name an older one with --checkpoint") from None
    return {n: state[entries[n][0]] for n in names}


def _dcp_failure(exc: CheckpointException) -> str:
    """The first rank's error, one line; a Ctrl-C that DCP caught and wrapped is raised again as itself."""
    failures = [failure for failure, _trace in exc.failures.values()]
    for failure in failures:
        if not isinstance(failure, Exception):
            raise failure
    return _first_line(failures[0]) if failures else "CheckpointException"


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
        tensors = dict(to_hf(name, t if dtype is None else t.to(dtype), cfg)
                       for name, t in read(shard).items())
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


def default_out(run_dir: Path, ckpt: Path) -> Path:
    return run_dir / "export" / ckpt.name


def check_out(out: Path, run_dir: Path, ckpt: Path) -> None:
    """Refuse an output path that holds files, or lies inside a checkpoint (an extra file would fail verification)."""
    for inside in (checkpoints.checkpoint_dir(run_dir), ckpt):
        if out.resolve().is_relative_to(inside.resolve()):
            raise ExportError(f"--out {out}: inside {inside}: an extra file there fails the checkpoint's verification")
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out}: is a file, not a folder; remove it or choose another --out")
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out}: already exists and is not empty; remove it or pass --out DIR")


def missing_parents(path: Path) -> list[Path]:
    """The ancestors of `path` that do not exist yet, deepest first (created by the export, removed on failure)."""
    missing = []
    for parent in path.absolute().parents:
        if parent.exists():
            break
        missing.append(parent)
    return missing


def export(
    run_dir: Path, checkpoint: str | None = None, out: Path | None = None, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    dtype: torch.dtype | None = None, verify: bool = False, lora_mode: str | None = None,
) -> tuple[Path, str | None]:
    """Export one verified checkpoint of `run_dir` (default: the newest valid one).

    Returns the output folder and, with `verify`, what the check against transformers found (models/verify.py);
    an export that fails the check is never moved to `out`.
    """
    cfg = read_model_config(run_dir)
    ckpt = find_checkpoint(run_dir, checkpoint)
    entries = model_entries(ckpt)
    names = check_against_config(entries, cfg, ckpt)
    lora_export.check_mode(cfg, lora_mode)
    if lora_mode == "adapter" and verify:
        raise ExportError("--verify loads full weights with transformers; use it with --merged, not --adapter")
    out = out or default_out(run_dir, ckpt)
    if not out.absolute().name or out.absolute() == Path.cwd():
        raise ExportError(f"--out {str(out) or repr('')}: the current folder or the filesystem root; name a new "
                          "folder, e.g. --out exports/mymodel")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    created = missing_parents(tmp)
    done = False
    tokens = run_tokenizer(run_dir)  # a damaged tokenizer record is refused before any file is written
    try:
        check_out(out, run_dir, ckpt)
        tmp.mkdir(parents=True)
        if lora_mode == "adapter":
            write_adapter_folder(run_dir, ckpt, entries, names, tmp, cfg, dtype, tokens)
            verified = None
        else:
            verified = write_full(ckpt, entries, names, tmp, max_shard_size, cfg, dtype, tokens, verify)
        tmp.rename(out)  # onto an empty folder or a free name; never a half-written folder at `out`
        done = True
    except (OSError, SafetensorError) as exc:  # writing the output; reads of the checkpoint raise ExportError
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else _first_line(exc)
        raise ExportError(f"--out {out}: cannot write the export there: {reason}") from None
    finally:
        if not done:
            shutil.rmtree(tmp, ignore_errors=True)
            for parent in created:
                with contextlib.suppress(OSError):
                    parent.rmdir()
    return out, verified


def write_full(ckpt: Path, entries: dict, names: list[str], out: Path, max_shard_size: int, cfg: ModelConfig,
               dtype: torch.dtype | None, tokens: dict | None, verify: bool) -> str | None:
    """The Hugging Face folder (a LoRA run's with its adapters merged); with `verify`, what the check found."""
    read = partial(read_tensors, ckpt, entries)
    if cfg.lora.rank > 0:
        read = lora_export.merged_reader(names, read, cfg.lora)
        names, cfg = lora_export.base_names(names), lora_export.base_config(cfg)
    write_weights(ckpt, entries, names, out, max_shard_size, cfg, dtype, read)
    write_config(cfg, ckpt, out, dtype or entries[names[0]][1].properties.dtype, tokens)
    write_tokenizer(tokens, cfg, out)
    return verify_export(out, read(names), cfg, dtype).line() if verify else None


def write_adapter_folder(run_dir: Path, ckpt: Path, entries: dict, names: list[str], out: Path, cfg: ModelConfig,
                         dtype: torch.dtype | None, tokens: dict | None) -> None:
    """A LoRA run's PEFT adapter folder (models/lora_export.py), with the run's tokenizer."""
    adapters = read_tensors(ckpt, entries, [n for n in names if n not in lora_export.base_names(names)])
    adapters = {n: t if dtype is None else t.to(dtype) for n, t in adapters.items()}
    init_from = load_run_config(run_dir).checkpoint.init_from
    lora_export.write_adapter(adapters, cfg, out, init_from)
    write_tokenizer(tokens, cfg, out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainctl.models.export",
                                     description="Export a checkpoint's model as safetensors.")
    parser.add_argument("run_dir", type=Path,
                        help=f"the run directory (holds {rundir.CONFIG} and {rundir.CHECKPOINTS}/)")
    parser.add_argument(
        "--checkpoint",
        help="a checkpoint directory, or its name under RUN_DIR/checkpoints; it must verify (default: newest valid)",
    )
    parser.add_argument("--out", type=Path, help="output folder (default: RUN_DIR/export/step-NNNNNNNN)")
    parser.add_argument("--max-shard-size", default=str(DEFAULT_MAX_SHARD_SIZE),
                        help="bytes per file before sharding (5000000000, 500MB, 2GiB)")
    parser.add_argument("--dtype", choices=sorted(EXPORT_DTYPES), help="cast the weights (default: as saved)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--merged", dest="lora_mode", action="store_const", const="merged",
                      help="a LoRA run: full weights with the adapters folded in")
    mode.add_argument("--adapter", dest="lora_mode", action="store_const", const="adapter",
                      help="a LoRA run: a PEFT adapter folder (adapter_config.json, adapter_model.safetensors)")
    parser.add_argument("--verify", action="store_true",
                        help="load the export with transformers and compare tensors and logits before calling it done")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: 0 on success, 2 with one line on stderr for a user error."""
    args = parse_args(argv)
    try:
        dtype = EXPORT_DTYPES[args.dtype] if args.dtype else None
        out, verified = export(args.run_dir, args.checkpoint, args.out, parse_size(args.max_shard_size), dtype,
                               verify=args.verify, lora_mode=args.lora_mode)
    except UserError as exc:  # ExportError, and lora_export's
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except VerifyError as exc:  # not the user's mistake: the conversion is wrong, and nothing was left at --out
        print(f"error: export --verify failed, nothing written: {exc}", file=sys.stderr)
        return 1
    files = sorted(p.name for p in out.iterdir())
    config = out / "config.json"  # a PEFT adapter folder has none
    step = json.loads(config.read_text())["trainctl_checkpoint"]["step"] if config.exists() else None
    print(f"exported {f'step {step} ' if step is not None else 'the adapters '}to {out}: {', '.join(files)}")
    if verified:
        print(verified)
    return 0


if __name__ == "__main__":
    sys.exit(main())
