"""The run's own copy of the tokenizer it trains with, made when its run directory is written.

A dataset folder can be prepared again, or moved, after a run started; an export must still bundle the tokenizer
the model learned. So the run directory keeps copies under tokenizer/ with their sha256 in tokenizer/record.json:
the prepared dataset's tokenizer.json (what the tokens were made with), and from a Hugging Face folder the run
starts from (checkpoint.init_from, model.path) its tokenizer files, tokenizer_config.json with its special tokens
and chat template and generation_config.json among them. The export (models/hf_folder.py) copies them from here,
checking each sha256. Only regular files of bounded size are read: a FIFO never blocks the launch.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from trainctl.config.schema import RunConfig
from trainctl.core import rundir as layout
from trainctl.launch.errors import LaunchError

HF_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
            "chat_template.jinja", "tokenizer.model")
MAX_FILE_BYTES = 256 << 20


def sources(cfg: RunConfig) -> tuple[dict[str, Path], dict]:
    """(file name -> where it is now, what the record says about them): the HF folder's files, then the dataset's
    tokenizer.json over the folder's (the data's tokens are what the model learns)."""
    files: dict[str, Path] = {}
    info: dict = {}
    folder = cfg.checkpoint.init_from or cfg.model.path
    if folder:
        root = Path(folder).expanduser()
        files.update({name: root / name for name in HF_FILES if (root / name).is_file()})
        info["hf_folder"] = str(root.resolve())
    if cfg.data.kind == "memmap" and cfg.data.datasets:
        from trainctl.data import format as dataset

        try:
            meta = dataset.read_meta(cfg.data.datasets[0])
        except dataset.DatasetError:
            return files, info  # validation reports an unusable dataset; nothing to record from it
        info.update(dataset=str(meta.root.resolve()), eos_id=meta.tokenizer.eos_id)
        if meta.tokenizer.file:
            files["tokenizer.json"] = meta.root / meta.tokenizer.file
        else:
            info["byte_tokens"] = True
    return files, info


def write(target: Path, cfg: RunConfig) -> None:
    """Copy the run's tokenizer files into target/tokenizer/ with record.json; nothing when there are none."""
    files, info = sources(cfg)
    if not files and not info:
        return
    folder = target / layout.TOKENIZER
    folder.mkdir()
    digests = {}
    for name, source in files.items():
        data = layout.read_bytes(source, MAX_FILE_BYTES)
        if data is None:
            raise LaunchError(f"{source}: the run's tokenizer file is not a regular file of at most "
                              f"{MAX_FILE_BYTES >> 20} MiB; point the run at a readable tokenizer")
        (folder / name).write_bytes(data)
        digests[name] = hashlib.sha256(data).hexdigest()
    record = {**info, "files": digests, "sources": {name: str(path) for name, path in files.items()}}
    (target / layout.TOKENIZER_RECORD).write_text(json.dumps(record, indent=2) + "\n")
