"""What every hostile case uses: the CLI in a fresh process with a deadline, and the checks that give a verdict.

A case is a function of a `Probe` (its own empty folder and the commands to run there). It returns when trainctl
did the right thing and raises `Verdict` otherwise. The checks here decide the common verdicts the same way for
every case: a command that outlives its deadline is a hang, a Python traceback on the user's screen is a
traceback, anything else that is not what a careful tool does is wrong; a case names `escape` (read or wrote
outside what it may) and `data loss` (a user's files gone or changed) itself.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

VERDICTS = ("OK", "traceback", "wrong", "hang", "escape", "data loss")
TRACEBACK = "Traceback (most recent call last)"


class Verdict(Exception):
    """A case's outcome other than OK: one of VERDICTS and what was seen."""

    def __init__(self, kind: str, detail: str = ""):
        assert kind in VERDICTS, kind
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


@dataclass(frozen=True)
class Case:
    area: str
    name: str
    fn: Callable[[Probe], None]
    slow: bool = False  # starts torch workers (seconds each)


CASES: list[Case] = []


def case(area: str, name: str, slow: bool = False):
    """Register a case: `@case("data", "a tokenizer with a sparse id")`."""

    def register(fn: Callable[[Probe], None]) -> Callable[[Probe], None]:
        CASES.append(Case(area, name, fn, slow))
        return fn

    return register


@dataclass
class Result:
    argv: list[str]
    code: int | None  # None: killed at its deadline
    out: str
    err: str

    @property
    def lines(self) -> list[str]:
        """The non-empty lines the user saw on stderr."""
        return [line for line in self.err.splitlines() if line.strip()]

    def brief(self) -> str:
        last = (self.lines or self.out.strip().splitlines() or [""])[-1]
        return f"exit {self.code}: {last[:160]}"


@dataclass
class Probe:
    """One case's world: an empty folder `tmp` (the working directory) and the trainctl to try (its PYTHONPATH)."""

    tmp: Path
    pythonpath: str
    env: dict[str, str] = field(default_factory=dict)

    def environ(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINCTL_", "WANDB_"))}
        env.update(PYTHONPATH=self.pythonpath, OMP_NUM_THREADS="1", HOME=str(self.tmp / "home"), COLUMNS="200",
                   WANDB_SILENT="true", **self.env, **(extra or {}))
        (self.tmp / "home").mkdir(exist_ok=True)
        return env

    def run(self, argv: list[str], timeout: float = 60, cwd: Path | None = None, env: dict | None = None,
            stdin: str | None = None, check_traceback: bool = True) -> Result:
        """Any program, in its own process group (killed whole at the deadline); a hang or traceback ends the case."""
        feed = subprocess.PIPE if stdin is not None else subprocess.DEVNULL
        proc = self.popen(argv, cwd=cwd, env=env, stdin=feed)
        try:
            out, err = proc.communicate(stdin, timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            what = " ".join(map(str, argv[-6:]))[:120]
            raise Verdict("hang", f"{what} still running after {timeout:.0f} s") from None
        result = Result([str(a) for a in argv], proc.returncode, out, err)
        if check_traceback and TRACEBACK in out + err:
            last = [line for line in (out + err).splitlines() if line.strip()][-1]
            raise Verdict("traceback", last[:200])
        return result

    def popen(self, argv: list[str], cwd: Path | None = None, env: dict | None = None, stdin=subprocess.DEVNULL,
              stdout=subprocess.PIPE, stderr=subprocess.PIPE) -> subprocess.Popen:
        """Start a program in its own process group, with Ctrl-C's default meaning restored.

        A harness started in the background (CI, `nohup`, `cmd &`) inherits SIGINT as ignored, and Python keeps
        ignoring what it inherits: a case that sends Ctrl-C would then test nothing.
        """
        return subprocess.Popen(argv, cwd=cwd or self.tmp, env=self.environ(env), stdin=stdin, stdout=stdout,
                                stderr=stderr, text=True, start_new_session=True, preexec_fn=_default_sigint)

    def cli(self, *args: str, **kwargs) -> Result:
        """`trainctl ARGS` as a user types it."""
        return self.run([sys.executable, "-m", "trainctl.cli", *map(str, args)], **kwargs)

    def python(self, code: str, *args: str, **kwargs) -> Result:
        return self.run([sys.executable, "-c", code, *map(str, args)], **kwargs)

    def files(self, root: Path | None = None) -> dict[str, bytes]:
        """Every regular file under `root` (default: the case's folder, home excluded) with its bytes."""
        root = root or self.tmp
        found = {}
        for path in sorted(root.rglob("*")):
            if "home" in path.relative_to(self.tmp if root == self.tmp else root).parts[:1]:
                continue
            if path.is_file() and not path.is_symlink():
                found[str(path.relative_to(root))] = path.read_bytes()
        return found


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# ---------------------------------------------------------------- the checks


def refused(r: Result, *words: str, one_line: bool = True, absent: tuple[str, ...] = ()) -> None:
    """Exit 2 with `error:` lines (one, unless `one_line` is False) that contain every word and none of `absent`."""
    if r.code == 0:
        raise Verdict("wrong", f"accepted (exit 0): {(r.out.strip().splitlines() or [''])[-1][:150]}")
    if r.code != 2:
        raise Verdict("wrong", f"exit {r.code} instead of 2: {r.brief()}")
    if not r.lines or not all(line.startswith("error: ") for line in r.lines if not line.startswith("note:")):
        raise Verdict("wrong", f"not `error:` lines: {r.lines[:2]}")
    errors = [line for line in r.lines if line.startswith("error: ")]
    if one_line and len(errors) != 1:
        raise Verdict("wrong", f"{len(errors)} error lines for one problem: {errors[:3]}")
    text = "\n".join(errors).lower()
    missing = [w for w in words if w.lower() not in text]
    if missing:
        raise Verdict("wrong", f"the message does not name {missing}: {errors[0][:200]}")
    said = [w for w in absent if w.lower() in text]
    if said:
        raise Verdict("wrong", f"the message says {said}, which is not so: {errors[0][:200]}")


def succeeded(r: Result, *words: str) -> None:
    if r.code != 0:
        raise Verdict("wrong", r.brief())
    text = (r.out + r.err).lower()
    missing = [w for w in words if w.lower() not in text]
    if missing:
        raise Verdict("wrong", f"output lacks {missing}")


def expect(condition: bool, kind: str, detail: str) -> None:
    if not condition:
        raise Verdict(kind, detail)


def nothing_left(p: Probe, before: dict[str, bytes], *paths: Path) -> None:
    """The case's folder holds what it held before the command, and each of `paths` does not exist."""
    after = p.files()
    added = sorted(set(after) - set(before))
    lost = sorted(set(before) - set(after))
    changed = sorted(k for k in set(before) & set(after) if before[k] != after[k])
    expect(not lost and not changed, "data loss", f"removed {lost[:3]} changed {changed[:3]}")
    expect(not added, "wrong", f"left behind {added[:3]}")
    for path in paths:
        expect(not path.exists() and not path.is_symlink(), "wrong", f"left behind {path.name}")


def write_json(path: Path, value) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value))
    return path
