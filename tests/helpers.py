"""What the tests share: the torchrun command and its environment, the CLI probe, waits, tolerances, file tools.

Import as `from tests.helpers import ...` (pytest puts the repository root on sys.path, see pyproject.toml;
`worker_env` puts it on PYTHONPATH, so worker entry scripts can import it too).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import pytest

from trainctl.config.schema import ModelConfig
from trainctl.launch.command import AGENT_MODULE, TORCHRUN_MODULE

if TYPE_CHECKING:
    import torch

REPO = Path(__file__).resolve().parents[1]
T = TypeVar("T")

# Llama 2 7B, the model the plan's memory and throughput figures are checked against (6,738,415,616 parameters).
LLAMA2_7B = ModelConfig(
    name="llama2_7b",
    dim=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=32,
    ffn_dim=11008,
    vocab_size=32000,
    max_seq_len=4096,
)

# --- tolerances ------------------------------------------------------------------------------------
# Two computations of the same math that sum in different orders (a cached and a full forward, two ranks and one,
# one CPU's kernels and another's) differ by rounding alone, and how much follows from the arithmetic. In the
# probabilistic model of rounding (Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019, Theorem 2.4), a chain of n
# operations at unit roundoff u = eps/2 lands within lam*sqrt(n)*u of the exact result, relative to the
# magnitudes it sums, with probability at least 1 - 2n*exp(-lam**2/2): lam is set so that a comparison fails by
# chance less than once in FAILURE_ODDS. A short chain takes the worst case instead when it is smaller, n*u/(1-n*u)
# (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., Lemma 3.1). Both sides round, so two results
# may differ by twice that. A bound read off one machine's differences passes there and fails on the next CPU's.
# Comparisons meant to be exact (bitwise resume, the same layout twice) use torch.equal or ==, not these.

FAILURE_ODDS = 1e9


def rounding_rel(dtype: torch.dtype, terms: int, sides: int = 2) -> float:
    """The relative difference rounding allows between two computations (`sides`=2) of a chain of `terms`
    operations in `dtype`, or between one and the exact result (`sides`=1, e.g. against a float64 reference);
    relative to the magnitudes summed."""
    import torch

    u = torch.finfo(dtype).eps / 2
    lam = math.sqrt(2 * math.log(2 * terms * FAILURE_ODDS))
    worst = terms * u / (1 - terms * u) if terms * u < 1 else math.inf
    return sides * min(lam * math.sqrt(terms) * u, worst)


def assert_close_fp(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, terms: int, *,
                    sides: int = 2, scale: float | None = None, what: str = "") -> None:
    """`actual` equals `expected` to the rounding of `terms` operations in `dtype` (see rounding_rel), compared in
    float64. The bound is relative to `scale`, by default the largest |expected|: it stands for the magnitudes each
    element summed (a relative test per element would ask for accuracy where a sum cancelled to nearly zero)."""
    import torch

    rel = rounding_rel(dtype, terms, sides)
    scale = float(expected.detach().abs().max()) if scale is None else scale
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rel, atol=rel * scale,
                               msg=lambda m: f"{what}: {m}\n(rounding allows {rel:.2e} of {scale:.3g}: "
                                             f"{terms} operations in {dtype}, {sides} side(s))")


def forward_terms(model: ModelConfig, seq_len: int) -> int:
    """The operations along one forward's longest chain: per block the two norms, the attention and MLP input
    projections and the attention output (dim each), the scores (head_dim), the softmax and the weighted values
    (seq_len each) and the MLP output (ffn_dim); then the last norm and the head (dim each)."""
    head_dim = model.head_dim or model.dim // model.n_heads
    block = 5 * model.dim + head_dim + 2 * seq_len + model.ffn_dim
    return model.n_layers * block + 2 * model.dim


def step_terms(model: ModelConfig, seq_len: int, tokens: int, grad_norm: bool = False) -> int:
    """The operations along one training step's chain: the forward, the backward (the same chain transposed), the
    loss (a log-sum-exp over the vocabulary, a mean over the step's `tokens`, which every weight gradient sums too);
    with `grad_norm`, the sum of squares over every parameter as well."""
    from trainctl.plan.flops import param_count

    terms = 2 * forward_terms(model, seq_len) + model.vocab_size + tokens
    return terms + (param_count(model) if grad_norm else 0)


# The largest of the worker tests' tiny runs (tests/dist/worker_runs.py: TINY with TINY_OVERRIDES' ffn_dim and
# the qwen3 runs' head_dim; a global batch of 8 sequences of 64 tokens by default).
TINY_SHAPE = ModelConfig(name="tiny", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176, vocab_size=256,
                         max_seq_len=64, head_dim=32)


def curve_rel(step: int, key: str = "loss", model: ModelConfig = TINY_SHAPE, seq_len: int = 64, batch: int = 8,
              dtype: torch.dtype | None = None) -> float:
    """How far `key` of a run (`batch` sequences of `seq_len` a step) may be off another computation of the same
    run after `step` steps (0: before any): each step's rounding carries into the next, so the chain is that long."""
    import torch

    per_step = step_terms(model, seq_len, batch * seq_len, grad_norm=key == "grad_norm")
    return rounding_rel(dtype or torch.float32, max(step, 1) * per_step)


def assert_curve_close(got: list[float], want: list[float], key: str, steps: Sequence[int] | None = None,
                       **shape: object) -> None:
    """Two series of `key`, logged at `steps` (default 1, 2, ...), agree to rounding step by step (curve_rel, to
    which `shape` goes: model, seq_len, batch); the message names the first step that does not."""
    steps = range(1, len(want) + 1) if steps is None else steps
    assert len(got) == len(want) == len(steps), f"{key}: {len(got)} values against {len(want)} at steps {steps}"
    for step, g, w in zip(steps, got, want, strict=True):
        rel = curve_rel(step, key, **shape)
        assert abs(g - w) <= rel * abs(w), (f"{key} at step {step}: {g!r} against {w!r}, relative "
                                            f"{abs(g - w) / abs(w):.2e} > {rel:.2e} (rounding's bound)")


# --- torchrun --------------------------------------------------------------------------------------

# Set by an outer torchrun (a test run under one): a worker must not inherit them.
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")


def worker_env(**extra: object) -> dict[str, str]:
    """This environment for worker processes: one thread per rank (2 cores), wandb quiet, no inherited rank."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", **{k: str(v) for k, v in extra.items()}}
    for name in RANK_VARIABLES:
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def torchrun_cmd(nproc: int, *program: str, max_restarts: int | None = None, args: tuple[str, ...] = (),
                 fork: bool = False) -> list[str]:
    """`torchrun --standalone --nproc_per_node=N [--max-restarts=R] [ARGS] PROGRAM...` with this interpreter.

    program: a script and its arguments, or "-m", a module and its arguments. fork: the agent of
    cluster.rank_start=fork (it starts `-m trainctl.train RUN_DIR` only); else plain torchrun (exec).
    """
    cmd = [sys.executable, "-m", AGENT_MODULE if fork else TORCHRUN_MODULE, "--standalone", f"--nproc_per_node={nproc}"]
    if max_restarts is not None:
        cmd.append(f"--max-restarts={max_restarts}")
    return [*cmd, *args, *program]


def run_group(cmd: list[str], timeout: float, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd)` with output captured as text, in a process group of its own that a timeout kills whole.

    subprocess.run's timeout kills only torchrun: its workers would go on as orphans, holding the cores (and the
    store's port) for the tests that follow. Here the whole group goes, and the TimeoutExpired carries the output.
    """
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


SPAWN_RANKS = REPO / "tests" / "dist" / "spawn_ranks.py"


def ranks_cmd(nproc: int, *program: str) -> list[str]:
    """N ranks of PROGRAM with torchrun's environment but without its agent (tests/dist/spawn_ranks.py): for the
    tests of what the workers compute; the tests of torchrun's own part (restarts, hangs, stops) use torchrun_cmd."""
    return [sys.executable, str(SPAWN_RANKS), str(nproc), *program]


def run_ranks(nproc: int, *program: str, timeout: float = 240, **env: object) -> subprocess.CompletedProcess:
    """N ranks of PROGRAM (ranks_cmd) to the end, output captured as text."""
    return run_group(ranks_cmd(nproc, *program), timeout, worker_env(**env))


# --- the CLI in a fresh interpreter ----------------------------------------------------------------

PROBE_PREFIX = "__PROBE__"
# The CLI's real entry point; on the way out it reports its exit code and whether torch or wandb got imported.
PROBE = f"""
import json, sys
sys.argv = ["trainctl", *sys.argv[1:]]
from trainctl.cli import main
code = None
try:
    main()
    code = 0
except SystemExit as exc:
    code = exc.code or 0
    raise
finally:
    heavy = sorted(m for m in ("torch", "wandb") if m in sys.modules)
    print("{PROBE_PREFIX}" + json.dumps({{"code": code, "heavy": heavy}}), file=sys.stderr)
"""


def cli_env(**extra: object) -> dict[str, str]:
    """The CLI's environment in tests: this checkout importable, one thread per rank, wandb off, no inherited rank."""
    return worker_env(WANDB_MODE="disabled", **extra)


def _cli_cmd(args: tuple[str, ...]) -> list[str]:
    return [sys.executable, "-c", PROBE, *args]


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 120, env: dict | None = None,
            **env_extra: object) -> subprocess.CompletedProcess:
    """`trainctl ARGS` as a user runs it, in a fresh interpreter, to the end (at most `timeout` seconds).

    A CompletedProcess whose `.probe` is {"code", "heavy"} (None if the CLI crashed before reporting) and whose
    `.stderr` is what the user saw, without the probe's line. env: the whole environment (default: `cli_env`);
    env_extra: variables added to it.
    """
    env = {**(cli_env() if env is None else env), **{k: str(v) for k, v in env_extra.items()}}
    proc = subprocess.run(_cli_cmd(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    lines = proc.stderr.splitlines()
    reports = [line for line in lines if line.startswith(PROBE_PREFIX)]
    proc.probe = json.loads(reports[-1][len(PROBE_PREFIX):]) if reports else None
    proc.stderr = "\n".join(line for line in lines if not line.startswith(PROBE_PREFIX))
    return proc


def start_cli(*args: str, cwd: Path | None = None, env: dict | None = None, **popen: object) -> subprocess.Popen:
    """`trainctl ARGS` started in the background (text output piped unless `popen` says otherwise).

    Its stderr ends with the probe's line (see run_cli); the caller owns the process: wait, kill, or read it.
    """
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **popen}
    return subprocess.Popen(_cli_cmd(args), cwd=cwd, env=cli_env() if env is None else env, **popen)


def cli_in_process(monkeypatch: pytest.MonkeyPatch, capture, *args: str) -> tuple[int, str, str]:
    """`trainctl ARGS` in this process (the unit tier starts no process): exit code, stdout, stderr.

    capture: pytest's capsys, or capsysbinary where the output may hold bytes that are not UTF-8 (decoded with
    replacement). A traceback is not caught: it fails the test.
    """
    from trainctl.cli import main

    monkeypatch.setattr(sys, "argv", ["trainctl", *args])
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    out, err = capture.readouterr()
    if isinstance(out, bytes):
        out, err = out.decode(errors="replace"), err.decode(errors="replace")
    return code, out, err


# --- waits -----------------------------------------------------------------------------------------

def wait_for(predicate: Callable[[], T], what: str, timeout: float = 120.0, *, proc: subprocess.Popen | None = None,
             report: Callable[[], str] | None = None, interval: float = 0.02) -> T:
    """The predicate's first true value; the test fails, naming `what`, if `proc` exits or time runs out first.

    report: what to add to the failure message (logs, the queue).
    """
    deadline = time.monotonic() + timeout
    details = (lambda: "\n" + report()) if report else (lambda: "")
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"process {proc.pid} exited ({proc.returncode}) while waiting for {what}{details()}")
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}{details()}")


# --- run directories -------------------------------------------------------------------------------

def make_run(runs_dir: Path, name: str, *, overrides: list[str] | None = None, steps: int = 10,
             launch: dict | None = None, metrics: list[dict] | None = None, progress: int | None = None,
             result: dict | None = None, checkpoints: tuple[int, ...] = (), workdir: Path | None = None) -> Path:
    """The run directory `runs_dir/name` in a given state, its files named by trainctl.core.rundir.

    overrides: the records a real launch writes (config, plan, launch.sh, ...), composed from them; without it,
    only what the run tables read: a config.yaml with `train.steps: steps` and an empty logs folder.
    launch, result: those records; metrics: the lines of metrics.jsonl; progress: progress.json's step;
    checkpoints: committed step folders (a manifest each, no tensors). Nothing is written for what is None.
    """
    from trainctl.core import rundir
    from trainctl.core.checkpoints import step_name

    if overrides is not None:
        from trainctl.config.compose import compose
        from trainctl.config.validate import resolve
        from trainctl.launch.rundir import create
        from trainctl.plan import build

        cfg = resolve(compose(overrides))
        run_dir = create(cfg, build(cfg), runs_dir, name, overrides, workdir=workdir or runs_dir.parent)
    else:
        run_dir = runs_dir / name
        (run_dir / rundir.LOGS).mkdir(parents=True)
        (run_dir / rundir.CONFIG).write_text(f"train:\n  steps: {steps}\n")
    records = {rundir.LAUNCH: launch, rundir.RESULT: result, rundir.PROGRESS: None if progress is None else
               {"step": progress}}
    for file, record in records.items():
        if record is not None:
            (run_dir / file).write_text(json.dumps(record))
    if metrics is not None:
        (run_dir / rundir.METRICS).write_text("".join(json.dumps(r) + "\n" for r in metrics))
    for step in checkpoints:
        folder = run_dir / rundir.CHECKPOINTS / step_name(step)
        folder.mkdir(parents=True)
        (folder / "manifest.json").write_text("{}")
    return run_dir


# --- files -----------------------------------------------------------------------------------------

@contextlib.contextmanager
def deadline(seconds: float, error: type[Exception] = TimeoutError) -> Iterator[None]:
    """Fail instead of hanging: SIGALRM raises `error` in this (the main) thread when the block runs longer than
    `seconds`; pure-Python work (a YAML expansion, a sweep grid, Hydra's parser) is interrupted."""

    def expire(_signum, _frame):
        raise error(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def write_exe(path: Path, body: str) -> None:
    """A bash script at `path`, executable (stub programs put on PATH)."""
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)


def truncate(path: Path) -> None:
    """Cut a file to half its size, as a crash during a write leaves it."""
    os.truncate(path, path.stat().st_size // 2)


def tool_argv(options_cls: type, args: list[str], result: Path | None = None) -> list[str]:
    """A tool child's arguments (core/tool_options.child_argv) from `[RUN_DIR, --flag value, --switch, ...]`, read
    with the flags the options class declares: tests keep writing a tool's options as a user types them."""
    import typing

    from trainctl.core.tool_options import declared

    by_flag = {o.flag: o for o in declared(options_cls)}
    run_dir, rest, values = args[0], list(args[1:]), {}
    while rest:
        option = by_flag[rest.pop(0)]
        kind = next((t for t in typing.get_args(option.type) if t is not type(None)), option.type)  # X | None: X
        values[option.name] = True if kind is bool else kind(rest.pop(0))
    argv = [str(run_dir), json.dumps(values)]
    return [*argv, str(result)] if result is not None else argv


def write_hf_weights(folder: Path, extra: dict[str, list[int]] | None = None, drop: tuple[str, ...] = (),
                     head: bytes | None = None) -> Path:
    """model.safetensors of zeros (F32) holding every tensor folder/config.json's model loads, by the family's spec.

    `extra`: more tensors (name -> shape); `drop`: tensors left out; `head`: an lm_head.weight of these bytes (a
    tied model's head shipped anyway). The plan reads headers (names, shapes, dtypes), not the values.
    """
    import struct

    from trainctl.config.hf_config import model_fields
    from trainctl.config.hf_tensors import EMBEDDING, HEAD, expected_tensors

    shapes = {k: v for k, v in expected_tensors(ModelConfig(**model_fields(folder))).items() if k not in drop}
    shapes.update(extra or {})
    blobs = {name: bytes(4 * math.prod(shape)) for name, shape in shapes.items()}
    if head is not None:
        shapes[HEAD] = shapes[EMBEDDING]
        blobs[HEAD] = head
    header, offset = {}, 0
    for name, shape in shapes.items():
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(blobs[name])]}
        offset += len(blobs[name])
    raw = json.dumps(header).encode()
    path = folder / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs[n] for n in shapes))
    return path
