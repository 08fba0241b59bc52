"""A Hugging Face model directory's shape, read from its config.json without torch.

`model=hf model.path=DIR` takes the model's family and shape from DIR/config.json; `checkpoint.init_from=DIR`
loads DIR's safetensors weights into it in the worker. Both are checked here on the login node: a
config.json that no family can run exactly (its spec's refusals: unknown model_type, biases a family lacks,
unimplemented rope scaling, another activation) is refused in one line, as are missing weights.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from trainctl.core.rundir import open_regular, read_bytes
from trainctl.models import registry

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
HFConfigError = registry.HFConfigError  # one line: what is wrong with the directory and what would work

MAX_CONFIG_BYTES = 4 << 20  # a config.json is a few KB; a larger one is not a model's


def read_config(path: str | Path) -> dict:
    """DIR/config.json as a dict; an HFConfigError when it is missing, not a regular file, too large, or not a
    JSON object."""
    where = Path(path).expanduser()
    if not where.is_dir():
        raise HFConfigError(f"{path}: not a directory; point it at a Hugging Face model folder "
                            f"(config.json and *.safetensors) or a Hub name (org/name)")
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
    """ModelConfig fields (family included) for the model at `path`; HFConfigError when trainctl cannot run it
    exactly. The family comes from config.json's model_type (or architectures); its spec reads the rest, every
    field checked for its type before use (nothing coerced)."""
    data = read_config(path)
    where = Path(path).expanduser() / CONFIG_FILE
    return registry.spec(registry.family_of_hf(data, where)).from_hf(data, where)


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a Hugging Face folder (the index's, or the single file); HFConfigError if none."""
    where = Path(path).expanduser()
    index = where / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise HFConfigError(f"{index}: not a safetensors index ({exc})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(n, str) for n in weight_map.values()):
            raise HFConfigError(f"{index}: not a safetensors index (weight_map is not a mapping of file names)")
        files = [_inside(where, index, name) for name in sorted(set(weight_map.values()))]
    elif (where / SINGLE_FILE).is_file():
        files = [where / SINGLE_FILE]
    else:
        raise HFConfigError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE}; save the model with "
                            "save_pretrained(..., safe_serialization=True)")
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        raise HFConfigError(f"{path}: the index names {absent[0]}, which is missing")
    return files


def _inside(where: Path, index: Path, name: str) -> Path:
    """A weight_map's file, which must lie in the folder: `../x` or `/abs` would load weights from outside it (a
    downloaded folder is data, never a pointer elsewhere). Judged by the name, not by resolving links: the Hugging
    Face cache's snapshot folders hold symlinks into its blobs/."""
    normal = os.path.normpath(name) if name else ""
    if not normal or os.path.isabs(normal) or normal == "." or normal.split(os.sep)[0] == "..":
        raise HFConfigError(f"{index}: its weight_map names {name!r}, outside {where}; every shard must be a file "
                            "in the model folder itself")
    return where / name


# safetensors dtypes the worker can load into a float model; integer ones are quantized or not weights at all
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header


def check_weight_headers(files: list[Path]) -> dict[str, Stored]:
    """Read each safetensors file's header (bounded; never a FIFO) and refuse, in one line, a header that is not
    safetensors, tensors stored as integers, or offsets past the end of the file (a truncated download).
    Returns every tensor's header entry by name, with where its bytes lie."""
    stored: dict[str, Stored] = {}
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
        stored.update({name: Stored(file, 8 + length, entry) for name, entry in header.items()
                       if name != "__metadata__"})
    return stored


@dataclass(frozen=True)
class Stored:
    """One tensor's safetensors header entry (dtype, shape, data_offsets) and where its file's data begins."""

    file: Path
    data_start: int
    entry: dict

    @property
    def shape(self):
        return self.entry.get("shape")

    def same_bytes(self, other: Stored, chunk: int = 16 << 20) -> bool:
        """Whether both tensors hold the same bytes (read a chunk at a time: an embedding can be gigabytes)."""
        sizes = [e.entry["data_offsets"][1] - e.entry["data_offsets"][0] for e in (self, other)]
        if sizes[0] != sizes[1]:
            return False
        with open(self.file, "rb") as a, open(other.file, "rb") as b:
            a.seek(self.data_start + self.entry["data_offsets"][0])
            b.seek(other.data_start + other.entry["data_offsets"][0])
            left = sizes[0]
            while left > 0:
                n = min(chunk, left)
                if a.read(n) != b.read(n):
                    return False
                left -= n
        return True


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
        offsets = entry["data_offsets"]
        end = offsets[-1] if offsets else None
        if len(offsets) != 2 or not all(isinstance(o, int) for o in offsets) or not 0 <= offsets[0] <= end:
            raise HFConfigError(f"{file}: tensor {name!r} has data offsets {offsets}, not [begin, end]; download or "
                                "save it again")
        if end > data_bytes:
            raise HFConfigError(f"{file}: tensor {name!r} ends at byte {end}, past the file's {data_bytes} data bytes "
                                "(a truncated file?); download or save it again")
