"""The Python API's boundary: every public function checks its arguments against its own annotations first.

A notebook that passes `workers="2"`, `dry_run="no"` or one path string where a list is expected gets one
`UserError` line per wrong argument (naming it, what it got and what would work) before anything runs, instead
of a TypeError from deep inside, a truthy string taken as True, or a string walked one character at a time.
The annotations are the single statement of what each argument may be; `checked` reads them, so a new function
or parameter is covered by adding the decorator, never by writing a check by hand.
"""

from __future__ import annotations

import collections.abc as abc
import functools
import importlib
import inspect
import numbers
import os
import types
import typing
from collections.abc import Callable
from pathlib import Path

from trainctl.core.errors import UserError

# The noun a list-of-strings parameter is made of, for its "one string" refusal.
_ITEM_NOUN = {"overrides": "override", "inputs": "path", "runs": "run"}
_SEQUENCES = (abc.Sequence, abc.Iterable, abc.Collection, list, tuple)


def checked(fn: Callable | None = None, *, options: str | type | None = None, passed: tuple[str, ...] = ()):
    """Decorate a public API function: its bound arguments are checked against its annotations on every call.

    `options`: what its `**kwargs` are handed to (a dataclass, or "module:function" imported when called); their
    names and types are checked against that one's annotations, less `passed` (the ones the function sets itself).
    """

    def wrap(fn: Callable) -> Callable:
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError as exc:
                raise UserError([f"api.{fn.__name__}: {exc}"]) from None
            if problems := argument_problems(fn, bound, options, passed):
                raise UserError(problems)
            return fn(*args, **kwargs)

        call.__api_checked__ = True
        return call

    return wrap(fn) if fn is not None else wrap


def argument_problems(fn: Callable, bound: inspect.BoundArguments, options, passed: tuple[str, ...]) -> list[str]:
    """One line per argument whose value its annotation does not allow."""
    hints = annotations(fn)
    problems = []
    for name, value in bound.arguments.items():
        kind = bound.signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            problems += _keyword_problems(fn, value, options, passed)
        elif name in hints and kind is not inspect.Parameter.VAR_POSITIONAL:
            problems += value_problems(name, value, hints[name])
    return problems


def _keyword_problems(fn: Callable, values: dict, options, passed: tuple[str, ...]) -> list[str]:
    if options is None:
        return []
    target = _target(options)
    allowed = {k: v for k, v in annotations(target).items()
               if k != "return" and k not in passed and k not in inspect.signature(fn).parameters}
    problems = []
    for name, value in values.items():
        if name not in allowed:
            problems.append(f"{name}={value!r}: not an option of api.{fn.__name__}; use one of: "
                            f"{', '.join(sorted(allowed))}")
        else:
            problems += value_problems(name, value, allowed[name])
    return problems


def _target(options: str | type) -> Callable:
    if isinstance(options, str):
        module, _, attr = options.partition(":")
        return getattr(importlib.import_module(module), attr)
    return options


@functools.cache
def annotations(obj: Callable) -> dict[str, object]:
    """The resolved annotations of a function or a dataclass (string annotations evaluated once)."""
    return typing.get_type_hints(obj)


def value_problems(name: str, value: object, hint: object) -> list[str]:
    """Why `value` does not fit `hint` (empty when it does), in lines that name the argument."""
    if _fits(value, hint):
        return []
    if isinstance(value, (str, bytes)) and _wants_sequence(hint):
        return [_one_string(name, value)]
    if _wants_sequence(hint) and isinstance(value, abc.Sequence) and not isinstance(value, (str, bytes)):
        item = _item_hint(hint)
        wrong = [f"{name}[{i}]={v!r}: expected {describe(item)}, not {type(v).__name__}"
                 for i, v in enumerate(value) if not _fits(v, item)]
        if wrong:
            return wrong
    return [f"{name}={value!r}: expected {describe(hint)}, not {type(value).__name__}"]


def _one_string(name: str, text: str | bytes) -> str:
    noun = _ITEM_NOUN.get(name, "item")
    example = repr(text.split()) if isinstance(text, str) and text.split() else "['...']"
    return f"{name}={text!r}: give a list of strings, one {noun} each (e.g. {example}), not one string"


def _fits(value: object, hint: object) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any or hint is object:
        return True
    if hint is None or hint is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, h) for h in args)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if hint is Path:
        return isinstance(value, os.PathLike)
    if hint in (typing.BinaryIO, typing.IO, typing.TextIO):
        return callable(getattr(value, "write", None))
    if origin in (abc.Callable,) or hint is abc.Callable:
        return callable(value)
    if origin in _SEQUENCES:
        if isinstance(value, (str, bytes)) or not isinstance(value, abc.Sequence):
            return False
        return not args or all(_fits(v, args[0]) for v in value)
    if origin in (dict, abc.Mapping):
        return isinstance(value, abc.Mapping)
    if isinstance(hint, type):
        return isinstance(value, hint)
    raise TypeError(f"api argument check: no rule for the annotation {hint!r}")


def _wants_sequence(hint: object) -> bool:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_wants_sequence(h) for h in typing.get_args(hint))
    return typing.get_origin(hint) in _SEQUENCES


def _item_hint(hint: object) -> object:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return next(_item_hint(h) for h in typing.get_args(hint) if _wants_sequence(h))
    return (typing.get_args(hint) or (typing.Any,))[0]


def describe(hint: object) -> str:
    """What a user may pass, in words: 'a string or a path or None', 'True or False', 'a list of strings'."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(describe(h) for h in args))
    if origin in _SEQUENCES:
        return f"a list of {_plural(describe(args[0]))}" if args else "a list"
    if origin is abc.Callable or hint is abc.Callable:
        return "a function"
    if origin in (dict, abc.Mapping):
        return "a dict"
    words = {bool: "True or False", int: "an int", float: "a number", str: "a string", Path: "a path",
             type(None): "None", None: "None", typing.BinaryIO: "a binary file open for writing"}
    if hint in words:
        return words[hint]
    return f"a {getattr(hint, '__name__', str(hint))}"


def _plural(words: str) -> str:
    return " or ".join(w.removeprefix("a ").removeprefix("an ") + "s" for w in words.split(" or "))
