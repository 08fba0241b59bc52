"""Hugging Face Hub names (`org/name`) where a model folder is expected, resolved through huggingface_hub's cache.

`model.path`, `checkpoint.init_from`, and `data prepare --tokenizer` take a folder; a value that is no folder on
disk but has a Hub name's shape is looked up in the cache (`HF_HUB_CACHE`, else huggingface_hub's default) and,
unless `HF_HUB_OFFLINE` is set, downloaded into it (only what trainctl reads: config, safetensors, tokenizer and
generation files). The answer is the snapshot folder `models--org--name/snapshots/<commit>`: the config keeps
that folder, so the revision is pinned by the run's own config, and `pin(folder)` reads the name and the commit
back from it for the run's records and the export. huggingface_hub is imported only when a Hub name is used.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# What a Hub repository id looks like: one owner, one name (huggingface_hub's own rule, minus `--` and `..`).
HUB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
# The files trainctl reads from a model repository; the rest (pytorch_model.bin, original/, gguf) is not fetched.
WANTED = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
          "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
          "tokenizer.model"]
SNAPSHOT = re.compile(r"(?:^|/)models--(?P<owner>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<commit>[0-9a-fA-F]{7,64})/?$")
TRUE = ("1", "ON", "YES", "TRUE")


class HubError(Exception):
    """One line: the name, why it could not be found, and how to fetch it."""


def is_hub_name(value: str) -> bool:
    """A value to look up on the Hub: shaped `org/name` and not a path that exists here."""
    return bool(HUB_NAME.match(value)) and ".." not in value and "--" not in value \
        and not Path(value).expanduser().exists()


def offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set: the cache only, never the network."""
    return any(os.environ.get(key, "").strip().upper() in TRUE for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def cache_dir() -> str | None:
    """Read at each call (huggingface_hub reads its environment once, at import)."""
    return os.environ.get("HF_HUB_CACHE") or None


def fetch_hint(name: str) -> str:
    return f"fetch it first with `hf download {name}` (or `huggingface-cli download {name}`)"


def resolve(value: str) -> str:
    """`value` unchanged when it is not a Hub name; else the cached snapshot folder of its main revision
    (downloaded first when online). HubError in one line when it can be neither found nor fetched."""
    if not is_hub_name(value):
        return value
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise HubError(f"{value}: not a folder here; a Hugging Face Hub name needs huggingface_hub: "
                       "pip install huggingface_hub (or pip install 'trainctl[hf]')") from None
    cache = cache_dir()
    try:
        return snapshot_download(value, cache_dir=cache, local_files_only=True, allow_patterns=WANTED)
    except LocalEntryNotFoundError:
        pass
    except Exception as exc:  # a malformed cache entry: huggingface_hub's own message says which
        raise HubError(f"{value}: its Hugging Face cache entry cannot be read ({_first_line(exc)})") from None
    where = cache or "huggingface_hub's default cache"
    if offline():
        raise HubError(f"{value}: not a folder, and not in the Hugging Face cache ({where}) while HF_HUB_OFFLINE "
                       f"is set; {fetch_hint(value)}, or point it at a model folder")
    try:
        return snapshot_download(value, cache_dir=cache, allow_patterns=WANTED)
    except Exception as exc:  # no network, no such repository, a gated one: all end the same way for the user
        raise HubError(f"{value}: not a folder, and the Hugging Face Hub could not give it "
                       f"({_first_line(exc)}); {fetch_hint(value)}, or point it at a model folder") from None


def pin(folder: str | Path) -> dict | None:
    """{"name": "org/name", "revision": commit} when `folder` is a Hub cache snapshot, else None."""
    match = SNAPSHOT.search(str(folder))
    if not match:
        return None
    return {"name": f"{match['owner']}/{match['name']}", "revision": match["commit"]}


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__
