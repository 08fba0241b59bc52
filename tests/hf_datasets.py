"""Hugging Face datasets for tests, without the network: a Hub dataset as the datasets cache holds it once fetched.

`cache_hub_dataset` writes `<datasets cache>/<owner>___<name>/default/0.0.0/<hash>/` (dataset_info.json and one
.arrow file per split), which is what `load_dataset("owner/name")` leaves after a download of a dataset of json
files, by datasets' own Json builder; with HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set, load_dataset of that name
then reads it ("Using the latest cached version"). The builder names its output after the data files; the two
folders are renamed to the names a Hub download gets (the repository's namespace, the `default` configuration).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

HASH = "0123456789abcdef"


def cache_hub_dataset(datasets_cache: Path, name: str, splits: dict[str, list[dict]]) -> Path:
    """The dataset `name` (owner/name) with these splits' rows in `datasets_cache` (HF_DATASETS_CACHE)."""
    from datasets.packaged_modules.json.json import Json

    owner, short = name.split("/")
    files = datasets_cache.parent / f"{owner}-{short}-files"
    files.mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        (files / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    builder = Json(cache_dir=str(datasets_cache), dataset_name=short, hash=HASH,
                   data_files={split: str(files / f"{split}.jsonl") for split in splits})
    builder.download_and_prepare()
    built = Path(builder.cache_dir)  # <cache>/<short>/default-<data files hash>/0.0.0/<HASH>
    target = datasets_cache / f"{owner}___{short}" / "default"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(built.parents[1]), str(target))
    shutil.rmtree(files)
    return target


def offline(monkeypatch, home: Path) -> Path:
    """This process offline, with its own HF_HOME; returns its datasets cache (what cache_hub_dataset fills)."""
    import datasets
    import huggingface_hub

    cache = home / "datasets"
    for variable, value in (("HF_HOME", str(home)), ("HF_DATASETS_CACHE", str(cache)), ("HF_HUB_OFFLINE", "1"),
                            ("HF_DATASETS_OFFLINE", "1")):
        monkeypatch.setenv(variable, value)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache
