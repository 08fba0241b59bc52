"""Choices and ranges are declared on their schema fields and validate checks every one of them from there:
a registry's names are its field's choices, and each declared bound refuses a value past it in one line."""

from __future__ import annotations

import dataclasses

import pytest

from trainctl.config import schema
from trainctl.config.validate import declared_problems, resolve
from trainctl.core import optimizers


def declared(cls=schema.RunConfig, prefix=""):
    """(dotted key, path of attribute names, metadata) of every field that declares choices or a range."""
    for f in dataclasses.fields(cls):
        key, sub = f"{prefix}.{f.name}" if prefix else f.name, getattr(schema, str(f.type), None)
        if isinstance(sub, type) and dataclasses.is_dataclass(sub):
            yield from declared(sub, key)
        elif "choices" in f.metadata or "range" in f.metadata:
            yield key, f.metadata


def past(meta):
    """A value the declaration refuses."""
    if "choices" in meta:
        return "no-such-option"
    low, high = meta["range"]
    return low - 1 if low is not None else high + 1


def with_value(cfg, key: str, value):
    head, _, rest = key.partition(".")
    if not rest:
        return dataclasses.replace(cfg, **{head: value})
    return dataclasses.replace(cfg, **{head: with_value(getattr(cfg, head), rest, value)})


DECLARED = dict(declared())


def test_every_config_group_declares_its_choices_and_ranges():
    for key in ("optim.name", "schedule.name", "model.family", "cluster.launcher", "sharding.strategy", "train.seed",
                "optim.lr", "schedule.decay_fraction", "cluster.rdzv_port", "logging.wandb.mode", "data.val_fraction"):
        assert key in DECLARED, key
    assert len(DECLARED) >= 60


# A cluster config is its backend's class: one of another launcher cannot be built (compose refuses the name first,
# with the same line: test_backends.py).
CONSTRUCTIBLE = [key for key in DECLARED if key != "cluster.launcher"]


@pytest.mark.parametrize("key", CONSTRUCTIBLE)
def test_each_declared_field_refuses_a_value_past_it_in_one_line(key):
    cfg = schema.RunConfig()
    assert declared_problems(cfg) == []
    problems = declared_problems(with_value(cfg, key, past(DECLARED[key])))
    assert len(problems) == 1 and problems[0].startswith(f"{key}="), problems


def test_a_registered_optimizer_is_a_valid_choice_without_touching_the_schema(monkeypatch):
    """The field's choices are the registry's names, read when checked: one source."""
    monkeypatch.setitem(optimizers.OPTIMIZERS, "sophia", dataclasses.replace(optimizers.spec("adamw"), name="sophia"))
    cfg = schema.RunConfig(optim=schema.OptimConfig(name="sophia"))
    assert resolve(cfg).optim.name == "sophia"
    monkeypatch.delitem(optimizers.OPTIMIZERS, "sophia")
    assert declared_problems(cfg) == [
        f"optim.name='sophia': not a valid choice; use one of: {', '.join(optimizers.names())}"]
