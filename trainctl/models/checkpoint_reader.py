"""Reading a trainctl checkpoint outside training: which checkpoint (a named one that verifies, or the newest
valid one), the run's model config, and the model tensors of its DCP files, in one process without a process
group.

Shared by the export (export.py), generation (generate.py) and evaluation (train/evaluate.py); kept apart from
the writing of a Hugging Face folder (hf_folder.py) because those readers need none of it. Every problem the
user can act on is an ExportError: one line naming the run, checkpoint or file.
"""

from __future__ import annotations

import pickle
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import yaml
from omegaconf.errors import OmegaConfBaseException
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from trainctl.config.load import load_run_config
from trainctl.config.schema import ModelConfig
from trainctl.core import checkpoints, model_record, rundir
from trainctl.core.errors import UserError
from trainctl.models import qlora
from trainctl.models.build import build_model

# Module wrappers (torch.compile, activation checkpointing, FSDP1) that may prefix saved names.
WRAPPER_SEGMENTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
DCP_METADATA = ".metadata"
# pickle documents no common base for what a damaged file raises ("including but not limited to" these).
PICKLE_ERRORS = (
    pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError, KeyError, TypeError, ValueError
)
# A config.yaml that does not load: YAML's and OmegaConf's errors share no base (OmegaConf's are mostly ValueError).
CONFIG_ERRORS = (OSError, ValueError, TypeError, KeyError, yaml.YAMLError, OmegaConfBaseException)


class ExportError(UserError):
    """A problem the user can fix; the message is one line."""


def first_line(exc: BaseException) -> str:
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
        raise ExportError(f"{run_dir / rundir.CONFIG}: cannot be read as a run config: {first_line(exc)}") from None


def read_metadata(ckpt: Path) -> Metadata:
    """The checkpoint's DCP metadata; a damaged or foreign `.metadata` is a user error naming it."""
    try:
        metadata = FileSystemReader(str(ckpt)).read_metadata()
    except OSError as exc:
        raise ExportError(f"{ckpt / DCP_METADATA}: unreadable ({exc.strerror or exc})") from None
    except PICKLE_ERRORS as exc:
        raise ExportError(f"{ckpt / DCP_METADATA}: not DCP checkpoint metadata ({first_line(exc)})") from None
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
    # The same shapes can compute otherwise (rope_theta, norm_eps, LoRA's alpha): the checkpoint's own record.
    saved = rundir.read_json(ckpt / checkpoints.META).get(model_record.KEY)
    line = model_record.refusal(str(ckpt), saved, cfg, "read it with the run that saved it, or restore this run's "
                                f"{rundir.CONFIG} as it was when the checkpoint was saved")
    if line:
        raise ExportError(line)
    return list(expected)


def tensor_bytes(item: TensorStorageMetadata) -> int:
    return item.size.numel() * item.properties.dtype.itemsize


def read_tensors(
    ckpt: Path, entries: dict[str, tuple[str, TensorStorageMetadata]], names: list[str]
) -> dict[str, torch.Tensor]:
    """Read the named tensors, whole, into CPU memory (DCP fills preallocated tensors by flat key)."""
    quantized = qlora.saved_nf4_names(ckpt, names)  # a 4-bit run's base: read into NF4 tensors, then dequantized
    state = {entries[n][0]: (qlora.placeholder if n in quantized else torch.empty)(
        entries[n][1].size, dtype=entries[n][1].properties.dtype) for n in names}
    with warnings.catch_warnings():
        # Loading in one process without a process group is exactly the intent here.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
        except CheckpointException as exc:  # DCP wraps whatever a shard read raised, per rank
            reason = _dcp_failure(exc)
            raise ExportError(f"{ckpt}: DCP cannot read it: {reason}; name an older one with --checkpoint") from None
    return {n: qlora.dequantized(state[entries[n][0]]) for n in names}


def _dcp_failure(exc: CheckpointException) -> str:
    """The first rank's error, one line; a Ctrl-C that DCP caught and wrapped is raised again as itself."""
    failures = [failure for failure, _trace in exc.failures.values()]
    for failure in failures:
        if not isinstance(failure, Exception):
            raise failure
    return first_line(failures[0]) if failures else "CheckpointException"
