"""Bounds on an override's shape, checked before Hydra's parser sees it: too deep, too long, control characters,
numbers of too many digits, no key. Each becomes one line instead of a RecursionError, a hang or Hydra's internals.

Separate from compose.py because sweeps and grids (launch/sweep.py, launch/grid.py) parse overrides before any
composition and call `check_override_shapes` first; it needs only Hydra's override parser, not a composition.
"""

from __future__ import annotations

import re
import shlex

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

from trainctl.config.errors import ConfigError

# Bounds on an override's shape, so that Hydra's parser (recursive, and int() on digits) answers in one line.
MAX_KEY_CHARS = 200  # the longest schema key is ~35 characters; a file name is at most 255 bytes
MAX_NESTING = 32  # levels of [ ] and { } in one value
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # none in a key
# None in a value but the whitespace a quoted value may hold (a newline is for each key's own check to judge).
_CONTROL_IN_VALUE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def check_override_shapes(overrides: list[str]) -> None:
    """Refuse, one line each, overrides Hydra's parser cannot answer in one line (too deep, too long, control
    characters, unreadable numbers); callers that parse overrides before composing (sweeps) call it first."""
    problems = [p for item in overrides if (p := _shape_problem(item))]
    if problems:
        raise ConfigError(problems)


def _shape_problem(item: str) -> str | None:
    """Why an override cannot be a key=value at all (one line), or None."""
    if not isinstance(item, str):
        return f"{item!r}: an override is text, key=value"
    key = item.partition("=")[0]
    shown = _CONTROL.sub(lambda m: repr(m.group())[1:-1], key if len(key) <= 60 else key[:40])
    shown += "" if len(key) <= 60 else f"...({len(key)} characters)"
    control = _CONTROL.search(key) or _CONTROL_IN_VALUE.search(item, len(key))
    if control:
        return (f"{shown}: the override holds a control character ({control.group()!r}); "
                "write it without NUL, escape or other control characters")
    if len(key.lstrip("+~")) > MAX_KEY_CHARS:
        return f"{shown}: a key longer than {MAX_KEY_CHARS} characters; keys are dotted names such as train.steps"
    if _nesting(item[len(key) + 1:]) > MAX_NESTING:
        return f"{shown}: the value nests lists or mappings more than {MAX_NESTING} deep; no setting needs that"
    try:
        parsed = OverridesParser.create().parse_override(item)
    except HydraException as exc:
        if str(exc).startswith(("token recognition error", "LexerNoViableAltException")):  # no rule for a character
            return (f"{item}: an unquoted value holds a character Hydra's override grammar does not take "
                    f"('#', non-ASCII letters, ...); quote the value for Hydra, inside the shell's quotes: "
                    f"{quoted_override(item)}")
        return None  # reported with Hydra's grammar hint when composing
    except (ValueError, RecursionError) as exc:
        if "digits" in str(exc):  # int() refuses more than sys.get_int_max_str_digits() digits
            return f"{shown}: a number of more digits than can be read; an int key holds at most 19 digits"
        return f"{shown}: the value cannot be read ({_first_line(exc)}); pass a shorter value"
    if not parsed.key_or_group:  # `+=[]` fails an assert inside Hydra; `=1`, `~`, `@pkg=1` get its internals
        return (f"{item if len(item) <= 60 else item[:40] + '...'}: no key before '='; overrides look like "
                "key=value, group=option, +key=value, ~key")
    return None


def quoted_override(item: str) -> str:
    """`key=value` as a shell word holding Hydra's quoted value: 'key="nvcr.io#nvidia/pytorch:25.01-py3"'."""
    key, _, value = item.partition("=")
    quote = "'" if '"' in value and "'" not in value else '"'  # the quote the value does not hold, if any
    return shlex.quote(f"{key}={quote}{value.replace(quote, chr(92) + quote)}{quote}")


def _nesting(value: str) -> int:
    """How deep [ ] and { } nest in an override value, outside quoted strings."""
    depth = deepest = 0
    quote = None
    escaped = False
    for char in value:
        if quote:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == quote:
                quote = None
        elif char in "'\"":
            quote = char
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:160] if text else type(exc).__name__
