"""A bound on what a config's `${...}` interpolations expand to, checked before OmegaConf resolves them.

OmegaConf resolves `a1: ${a0}${a0}`, `a2: ${a1}${a1}`, ... by resolving each reference again, so forty
such lines (in a recipe's `cluster.env`, or as overrides) are 2^40 resolutions and a string as long: the
"billion laughs" of interpolations, which never finishes. `check` estimates, from the unresolved
values, how many references each key resolves and how many characters it becomes (references counted
each time they appear, a referenced mapping or list as all of its values) and refuses a config whose
total passes the bounds, naming the key that expands most. Estimates only ever overcount.
"""

from __future__ import annotations

import re

from trainctl.config.errors import ConfigError

MAX_RESOLUTIONS = 100_000  # a config has a few dozen references at most
MAX_CHARS = 16 * 2**20

# `${` not escaped (an odd run of backslashes before it makes it literal), then a key or a resolver's name.
_OPEN = re.compile(r"(\\*)\$\{\s*([^${}:\s]*)\s*(:)?")
_SELECT_ARG = re.compile(r"\s*([^,}\s]+)")


def check(data) -> None:
    """Raise ConfigError if the interpolations of a plain config container (unresolved) expand too far."""
    leaves: dict[str, object] = {}
    children: dict[str, list[str]] = {}
    _flatten(data, "", leaves, children)
    if not any(isinstance(v, str) and "${" in v for v in leaves.values()):
        return
    memo: dict[str, tuple[int, int]] = {}
    costs = {key: _cost(key, leaves, children, memo, set()) for key in leaves}
    if sum(c[0] for c in costs.values()) > MAX_RESOLUTIONS or sum(c[1] for c in costs.values()) > MAX_CHARS:
        key, (count, chars) = max(costs.items(), key=lambda item: item[1])
        raise ConfigError([f"{key}: its ${{...}} references expand to {count:,} resolutions and {chars:,} "
                           "characters (references of references); write the value out instead"])


def _flatten(node, key: str, leaves: dict, children: dict) -> None:
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else None
    if items is None:
        leaves[key] = node
        return
    names = children.setdefault(key, [])
    for name, value in items:
        child = f"{key}.{name}" if key else str(name)  # list items too: a.0 is how `${a[0]}` is looked up here
        names.append(child)
        _flatten(value, child, leaves, children)


def _cost(key: str, leaves: dict, children: dict, memo: dict, open_keys: set) -> tuple[int, int]:
    """(resolutions, characters) of resolving `key`: a value, or every value of a mapping or list."""
    if key in memo:
        return memo[key]
    if key in open_keys:
        return (1, 0)  # a cycle: OmegaConf reports it itself
    open_keys.add(key)
    if key in children:
        parts = [_cost(child, leaves, children, memo, open_keys) for child in children[key]]
        result = (1 + sum(p[0] for p in parts), sum(p[1] for p in parts))
    else:
        value = leaves.get(key)
        text = value if isinstance(value, str) else str(value)
        count, chars = 1, len(text)
        for ref in references(text, key):
            sub = _cost(ref, leaves, children, memo, open_keys)
            count, chars = count + sub[0], chars + sub[1]
        result = (count, chars)
    open_keys.discard(key)
    memo[key] = result
    return result


def references(text: str, key: str) -> list[str]:
    """The keys a string's interpolations refer to (absolute), each as often as it appears."""
    found = []
    for match in _OPEN.finditer(text):
        if len(match.group(1)) % 2:
            continue  # \${ : a literal
        name, resolver = match.group(2), match.group(3)
        if resolver:
            if name == "oc.select" and (arg := _SELECT_ARG.match(text, match.end())):
                found.append(_absolute(arg.group(1), key))
            continue  # other resolvers read no key; a `${...}` in their arguments is matched on its own
        if name:
            found.append(_absolute(name, key))
    return found


def _absolute(ref: str, key: str) -> str:
    """The dotted key a reference names: `${.x}` and `${..x}` relative to the referring key's parent, and
    `a[0]`, `a['b']` as a.0, a.b."""
    ref = re.sub(r"\[\s*['\"]?([^\]'\"]*)['\"]?\s*\]", r".\1", ref)
    if not ref.startswith("."):
        return ref
    dots = len(ref) - len(ref.lstrip("."))
    parent = key.split(".")[:-dots]
    rest = ref[dots:]
    return ".".join([*parent, rest]) if rest else ".".join(parent)
