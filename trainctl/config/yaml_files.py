"""Reading a config YAML file safely: regular files only, bounded in size, aliases and nesting bounded.

Every YAML that trainctl composes or reloads (recipes, group options, a run's config.yaml) goes
through `load`. OmegaConf's own loader (the float and duplicate-key rules `OmegaConf.load` uses) reads
it, with these bounds, so that a hostile or broken file is one line naming it instead of a hang:
- only a regular file is opened (a FIFO or device would block the reader) and at most MAX_BYTES read;
- anchors and aliases are fine, but the tree they expand to is at most MAX_NODES nodes ("billion
  laughs": nine aliases of nine aliases... expand to 10^9 nodes, which OmegaConf would copy one by one)
  and may not contain itself;
- nesting is at most MAX_DEPTH levels (a config is a handful deep; PyYAML recurses per level).
Errors are `ConfigFileError` lines `FILE:LINE:COLUMN: what is wrong; what would work`.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import yaml
from omegaconf._utils import get_yaml_loader

from trainctl.config.errors import ConfigFileError

MAX_BYTES = 1 << 20  # a recipe is about 1 KiB and a run's config.yaml about 4 KiB
MAX_NODES = 100_000  # the schema has about 150 keys
MAX_DEPTH = 32


def read_text(path: Path, max_bytes: int = MAX_BYTES, name: str | None = None, syntax_errors: bool = True) -> str:
    """The text of a regular file, at most `max_bytes`; ConfigFileError (one line) otherwise.

    `name` starts each line (default: the path; "" for none, when the caller names the file itself).
    With syntax_errors=False a file that is not UTF-8 raises the UnicodeDecodeError itself.
    """
    name = str(path) if name is None else name
    try:
        # O_NONBLOCK: opening a FIFO for reading must not wait for a writer; it is refused just below.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise ConfigFileError([_line(name, f"cannot be read ({why}); check that it exists and is readable")]) \
            from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigFileError([_line(name, "not a regular file; a config is a .yaml file")])
        data = b""
        while len(data) <= max_bytes:
            chunk = os.read(fd, max_bytes + 1 - len(data))
            if not chunk:
                break
            data += chunk
    except OSError as exc:
        raise ConfigFileError([_line(name, f"cannot be read ({exc.strerror or exc})")]) from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise ConfigFileError([_line(name, f"larger than {max_bytes // 1024} KiB; a config file is a few KiB of YAML")])
    try:
        return data.decode("utf-8-sig")  # a byte-order mark some editors write is not part of the text
    except UnicodeDecodeError as exc:
        if not syntax_errors:
            raise
        where = _at(name, data[: exc.start].count(b"\n") + 1)
        raise ConfigFileError([f"{where}: not UTF-8 text (byte {data[exc.start]:#04x}); save it as UTF-8"]) from None


def load(path: Path, max_bytes: int = MAX_BYTES, name: str | None = None, syntax_errors: bool = True):
    """The plain data (dict, list, scalar or None) of a YAML file, read with the bounds of the module doc.

    With syntax_errors=False a YAML syntax error raises PyYAML's own error (readers that report those);
    the bounds are ConfigFileError lines either way.
    """
    name = str(path) if name is None else name
    return parse(read_text(path, max_bytes, name, syntax_errors), name, syntax_errors)


def parse(text: str, name: str, syntax_errors: bool = True):
    """The plain data of YAML `text`; `name` (the file, or "") starts every error line."""
    loader = None
    try:
        loader = get_yaml_loader()(text)  # its reader already refuses a NUL or other control character
        node = loader.get_single_node()
        if node is None:
            return None
        _check_tree(node, name)
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        if not syntax_errors:
            raise
        raise ConfigFileError([_yaml_error_line(exc, name, text)]) from None
    except RecursionError:
        raise ConfigFileError([_line(name, f"nested more than {MAX_DEPTH} levels deep; a config is a few levels "
                                           "deep")]) from None
    except ConfigFileError:
        raise  # _check_tree's own line (a ValueError too)
    except ValueError as exc:  # a constructor's int() or float() (an integer of more than 4300 digits)
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigFileError([_line(name, f"a value cannot be read ({first[:120]}); write a shorter one")]) \
            from None
    finally:
        if loader is not None:
            loader.dispose()


def _line(name: str, text: str) -> str:
    return f"{name}: {text}" if name else text


def _at(name: str, line: int, column: int | None = None) -> str:
    """Where in the file: `FILE:LINE:COLUMN`, or `line L, column C` when the caller names the file."""
    if name:
        return f"{name}:{line}" + ("" if column is None else f":{column}")
    return f"line {line}" + ("" if column is None else f", column {column}")


def _check_tree(root: yaml.Node, name: str) -> None:
    """Refuse a tree that nests too deep, contains itself, or expands (aliases counted each time) too far."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node, depth: int) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]  # an alias: the same node again, counted again by the caller
        if key in open_nodes:
            raise ConfigFileError([f"{_where(node, name)}: an alias refers to a node that contains it; "
                               "write the values out instead"])
        if depth > MAX_DEPTH:
            raise ConfigFileError([f"{_where(node, name)}: nested more than {MAX_DEPTH} levels deep; "
                               "a config is a few levels deep"])
        open_nodes.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            total += sum(size(child, depth + 1) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            total += sum(size(k, depth + 1) + size(v, depth + 1) for k, v in node.value)
        open_nodes.discard(key)
        if total > MAX_NODES:
            raise ConfigFileError([f"{_where(node, name)}: its aliases expand to more than {MAX_NODES:,} values "
                               "(nested anchors); write the values out instead"])
        sizes[key] = total
        return total

    size(root, 0)


def _where(node: yaml.Node, name: str) -> str:
    return _at(name, node.start_mark.line + 1, node.start_mark.column + 1)


def _yaml_error_line(exc: yaml.YAMLError, name: str, text: str) -> str:
    """PyYAML's error as one line: the file, line and column of the problem, what it is."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    where = (name or "the file") if mark is None else _at(name, mark.line + 1, mark.column + 1)
    if isinstance(exc, yaml.reader.ReaderError):  # a character YAML does not accept (a NUL, a control character)
        before = text[: exc.position]
        where = _at(name, before.count("\n") + 1, len(before) - before.rfind("\n"))
        char = exc.character if isinstance(exc.character, int) else ord(exc.character)
        problem = f"unacceptable character #x{char:04x}"
    context = getattr(exc, "context", None)
    text = f"{context}: {problem}" if context and "constructor" not in problem else problem
    hint = "fix the YAML"
    if "could not determine a constructor" in problem:
        hint = "config files hold plain values: no !!python or other language tags"
    return f"{where}: not valid YAML: {' '.join(text.split())}; {hint}"
