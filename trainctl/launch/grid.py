"""A sweep's grid: Hydra's sweep grammar (`a=1,2`, `range()`, `choice()`, `glob()`) expanded into points, bounded.

Hydra's BasicSweeper builds the whole cross product in memory and raises whatever its parser or OmegaConf raise
(`range(0,1e300)` never ends, `range(0,10,0)` is a ValueError, `range(nan,3)` a decimal error, `{}` in a list an
OmegaConf error). Here every override is parsed on its own (a problem names it), every swept value is counted
before it is listed, and the number of points is checked before the product is built.
"""

from __future__ import annotations

import decimal
import itertools
import math
from collections.abc import Callable

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Glob, Override, RangeSweep, Sweep
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from trainctl.config.errors import ConfigError
from trainctl.config.override_shapes import check_override_shapes
from trainctl.config.schema import GROUPS

# Slurm's default MaxArraySize is 1001 (task ids 0..1000); every point is also composed and planned before any
# starts, so a bigger grid is a typo (a range() without its step) far more often than a plan.
MAX_POINTS = 1000
GRID_HINT = "a grid sweep takes lists (a=1,2,3), range(start,stop,step) or choice(a,b)"
# What the grammar's evaluation may raise on a user's text (Hydra wraps most of it, not all of it).
_PARSE_ERRORS = (HydraException, OmegaConfBaseException, ValueError, TypeError, ArithmeticError, AssertionError)


def expand(overrides: list[str], group_options: Callable[[str], list[str]] | None = None) -> list[list[str]]:
    """The sweep's points, each a list of plain overrides (the cross product, in the order given).

    `group_options(group)` lists a config group's options for `glob()`; without it glob() is refused.
    A key given twice keeps its last values (as Hydra's basic sweeper does).
    """
    check_override_shapes(list(overrides))
    values: dict[str, list[str]] = {}
    problems = []
    for item in overrides:
        try:
            key, listed = _values(item, group_options)
        except ConfigError as exc:
            problems += exc.problems
            continue
        values[key] = listed
    if problems:
        raise ConfigError(problems)
    _check_size(values)
    return [list(point) for point in itertools.product(*values.values())]


def _values(item: str, group_options: Callable[[str], list[str]] | None) -> tuple[str, list[str]]:
    """One override's key (as Hydra keys it: with its +, ~ or @package) and the values it sweeps, as text."""
    try:
        override = OverridesParser.create().parse_overrides([item])[0]
        key = override.get_key_element()
        if not override.is_sweep_override():
            return key, [f"{key}={override.get_value_element_as_str()}"]
        if override.is_interval_sweep():
            raise ConfigError([f"{item}: interval() needs a sampling sweeper (Optuna, Nevergrad); {GRID_HINT}"])
        if isinstance(override.value(), Glob):
            listed = _glob(item, override, group_options)
        else:
            _count(item, override.value())
            listed = list(override.sweep_string_iterator())
    except _PARSE_ERRORS as exc:
        raise ConfigError([f"{item}: {_reason(exc)}; {GRID_HINT}"]) from None
    if not listed:
        raise ConfigError([f"{item}: the sweep has no points (an empty range() or list); give the key at least "
                           "one value"])
    return key, [f"{key}={value}" for value in listed]


def _count(item: str, value: object) -> int:
    """How many values a swept value lists, without listing them; refuses a range that is not finite."""
    if isinstance(value, RangeSweep):
        return _range_length(item, value)
    elements = getattr(value, "list", None)
    if elements is None:
        return 1
    if any(isinstance(e, Sweep) for e in elements):
        raise ConfigError([f"{item}: a range() or choice() inside a list of values; sweep it on its own "
                           "(a=range(0,3)) or write the values out (a=0,1,2,5)"])
    if len(elements) > MAX_POINTS:
        raise ConfigError([f"{item}: {len(elements)} values; a sweep has at most {MAX_POINTS} points"])
    return len(elements)


def _range_length(item: str, r: RangeSweep) -> int:
    try:
        start, stop, step = (decimal.Decimal(x) for x in (r.start, r.stop, r.step))  # exactly as Hydra's FloatRange
    except (TypeError, ValueError, ArithmeticError):
        raise ConfigError([f"{item}: range() takes numbers; {GRID_HINT}"]) from None
    if not all(x.is_finite() for x in (start, stop, step)) or step == 0:
        raise ConfigError([f"{item}: range(start,stop,step) needs finite numbers and a step other than 0, "
                           "e.g. range(0,10,2)"])
    length = max(0, math.ceil((stop - start) / step))
    if length > MAX_POINTS:
        raise ConfigError([f"{item}: {_big(length)} values; a sweep has at most {MAX_POINTS} points "
                           "(a bigger step: range(start,stop,step))"])
    return length


def _glob(item: str, override: Override, group_options: Callable[[str], list[str]] | None) -> list[str]:
    group = override.key_or_group
    if group not in (*GROUPS, "recipe") or group_options is None:
        raise ConfigError([f"{item}: glob() picks a config group's options (model=glob(*), recipe=glob(tiny*)); "
                           f"groups: {', '.join((*GROUPS, 'recipe'))}"])
    return override.value().filter(sorted(group_options(group)))


def _check_size(values: dict[str, list[str]]) -> None:
    total = math.prod(len(v) for v in values.values())
    if total > MAX_POINTS:
        swept = [f"{key} ({len(v)})" for key, v in values.items() if len(v) > 1]
        raise ConfigError([f"-m: {_big(total)} points ({' x '.join(swept)}); a sweep has at most {MAX_POINTS}; "
                           "split it into several sweeps or sweep fewer values"])


def _big(n: int) -> str:
    return str(n) if n < 10**12 else f"about 1e{len(str(n)) - 1}"


def _reason(exc: BaseException) -> str:
    """Hydra's or OmegaConf's explanation in one line: not its 'Error parsing override' header or its docs link."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    useful = [line for line in lines if not line.startswith(("Error parsing override", "See https://"))]
    text = (useful or lines or [type(exc).__name__])[0]
    return text.encode("unicode_escape").decode("ascii") if not text.isprintable() else text
