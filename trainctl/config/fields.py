"""Choices and ranges declared with their fields, and the one generic check of them (torch-free).

schema.py declares each checked field with one of these helpers, e.g. `lr: float = positive(3e-4)` or
`name: str = choice("adamw", optimizers.names)`; `declared_problems(cfg)` walks a config's dataclasses and
checks every declaration, one line per problem (validate calls it). A registry's names are its field's
choices: pass the function that lists them, called at check time, so a backend, family or optimizer
registered later is a valid choice without touching the schema.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import field

CHOICE_WORDING = "not a valid choice; use one of"


def choice(default: str, names, wording: str = CHOICE_WORDING):
    """A string field whose value must be one of `names` (a tuple, or a function returning one)."""
    return field(default=default, metadata={"choices": names, "wording": wording})


def positive(default):
    return field(default=default, metadata={"range": (0, None), "open_low": True})


def at_least(default, low, hint: str = "", message: str = ""):
    return field(default=default, metadata={"range": (low, None), "hint": hint, "message": message})


def at_most(default, high):
    return field(default=default, metadata={"range": (None, high)})


def within(default, low, high, open_low: bool = False, message: str = ""):
    return field(default=default, metadata={"range": (low, high), "open_low": open_low, "message": message})


def declared_problems(node, prefix: str = "") -> list[str]:
    """Every field's declared choices and range (schema.choice, positive, at_least, at_most, within), walking the
    config's dataclasses in schema order; one line per problem."""
    problems = []
    for name, meta, nested in _declared_fields(type(node)):
        key, value = f"{prefix}.{name}" if prefix else name, getattr(node, name)
        if nested:
            problems += declared_problems(value, key)
        elif "choices" in meta:
            problems += _choice(key, value, meta)
        elif "range" in meta:
            problems += _range(key, value, meta)
    return problems


@functools.cache
def _declared_fields(cls: type) -> tuple[tuple[str, dict, bool], ...]:
    """(name, metadata, is a nested config) of each field that declares a check or holds a config (per class: once)."""
    out, hints = [], typing.get_type_hints(cls)  # the annotations are strings (postponed): resolve them once
    for f in dataclasses.fields(cls):
        nested = isinstance(hints.get(f.name), type) and dataclasses.is_dataclass(hints[f.name])
        if nested or "choices" in f.metadata or "range" in f.metadata:
            out.append((f.name, dict(f.metadata), nested))
    return tuple(out)


def _choice(key: str, value: str, meta: dict) -> list[str]:
    allowed = meta["choices"]() if callable(meta["choices"]) else meta["choices"]
    if value in allowed:
        return []
    return [f"{key}={value!r}: {meta['wording']}: {', '.join(allowed)}"]


def _range(key: str, value: float, meta: dict) -> list[str]:
    low, high = meta["range"]
    open_low = meta.get("open_low", False)
    ok = (low is None or (value > low if open_low else value >= low)) and (high is None or value <= high)
    if ok:
        return []
    if meta.get("message"):
        return [f"{key}={value}: {meta['message']}"]
    if high is None and open_low:
        return [f"{key}={value}: must be > {low}"]
    if high is None:
        hint = meta.get("hint", "")
        return [f"{key}={value}: must be >= {low}{'; ' + hint if hint else ''}"]
    if low is None:
        return [f"{key}={value}: must be <= {high}"]
    return [f"{key}={value}: must be in {'(' if open_low else '['}{low}, {high}]"]

