"""The model families, found by folder: `trainctl/models/<family>/spec.py` makes `<family>` a family (torch-free).

Launcher side (config, plan) and worker side ask a family's spec, picked by `model.family`, for its shape; the
worker gets the torch module and parallel plan from trainctl/models/build.py. A new family is a folder with
spec.py (exposing SPEC), model.py and parallel.py, and a model YAML: nothing here names a family.

Also here: the typed readers of config.json values that every family's `from_hf` uses, and their error.
"""

from __future__ import annotations

import importlib
import json
import math
from functools import cache
from pathlib import Path

FAMILIES_DIR = Path(__file__).resolve().parent


class HFConfigError(ValueError):
    """One line: what is wrong with the Hugging Face folder and what would work."""


@cache
def names() -> tuple[str, ...]:
    """Every family: the folders next to this module that hold a spec.py."""
    return tuple(sorted(d.name for d in FAMILIES_DIR.iterdir() if (d / "spec.py").is_file()))


@cache
def spec(family: str):
    """The family's spec (its module's SPEC); KeyError for an unknown family. Cached: the plan asks per tensor."""
    if family not in names():
        raise KeyError(family)
    return importlib.import_module(f"trainctl.models.{family}.spec").SPEC


def family_of_hf(data: dict, where: Path) -> str:
    """The family whose spec claims a config.json (by model_type, then architectures); HFConfigError if none."""
    model_type = data.get("model_type")
    for family in names():
        if model_type in spec(family).hf_model_types:
            return family
    architectures = data.get("architectures")
    for family in names():
        if isinstance(architectures, list) and set(map(str, architectures)) & set(spec(family).hf_architectures):
            return family
    known = ", ".join(t for f in names() for t in spec(f).hf_model_types)
    raise HFConfigError(f"{where}: model_type={shown(model_type)}; trainctl's families load model_type {known}")


def shown(value) -> str:
    """A config value as the user wrote it, cut to 40 characters."""
    text = repr(value) if isinstance(value, str | float) else json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def size(where: Path, data: dict, key: str) -> int:
    """A positive integer (not a bool, a float or a string): nothing is coerced."""
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        what = "missing" if key not in data else f"{key}={shown(value)}"
        raise HFConfigError(f"{where}: {what}: {key} must be a positive integer")
    return value


def positive_float(where: Path, key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise HFConfigError(f"{where}: {key}={shown(value)}: must be a positive finite number")
    return float(value)


def flag(where: Path, data: dict, key: str, default: bool) -> bool:
    value = data.get(key, default)
    if not isinstance(value, bool):
        raise HFConfigError(f"{where}: {key}={shown(value)}: must be true or false")
    return value


def mapping(where: Path, data: dict, key: str) -> dict:
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise HFConfigError(f"{where}: {key}={shown(value)}: must be a JSON object or null")
    return value
