"""Helpers for the worker tests: write a run directory by hand, run the worker, read what it wrote."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from tests.helpers import assert_curve_close, ranks_cmd, run_group, worker_env
from trainctl.config.load import to_yaml
from trainctl.config.schema import (
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    ScheduleConfig,
    TrainConfig,
)
from trainctl.core import hangs

WORKER_TIMEOUT_S = 240
# The tiny model as CLI overrides of recipe=tiny_cpu, for tests that launch through `trainctl`: seconds per run.
TINY_OVERRIDES = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=176",
                  "train.seq_len=64"]

# Tiny enough that a step is milliseconds on one core; fp32 so every run is bitwise-reproducible.
TINY = ModelConfig(name="test", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256, max_seq_len=64)


def base_config(cache_dir: Path, **train) -> RunConfig:
    """A fp32 run on the stdlib byte corpus: global batch 8 of 64 tokens, logged every step."""
    # Evaluation at step 0 and at the last step only, unless a test asks for more (or for none: eval_every=0).
    train.setdefault("eval_every", train.get("steps", 30))
    # A hang dumps every rank's stack and ends the worker well before the test's own timeout (WORKER_TIMEOUT_S):
    # train_and_check's failure message then shows where it stuck (see train/loop/watchdog.py).
    train_cfg = TrainConfig(steps=30, seq_len=64, global_batch=8, micro_batch=8, grad_accum=1, seed=1,
                            eval_batches=2, hang_timeout_s=WORKER_TIMEOUT_S / 2)
    return RunConfig(
        name="dist-test",
        model=TINY,
        optim=OptimConfig(lr=1e-3, weight_decay=0.1, grad_clip=1.0),
        schedule=ScheduleConfig(name="cosine", warmup_steps=2, min_lr_ratio=0.1),
        data=DataConfig(kind="stdlib", cache_dir=str(cache_dir)),
        train=replace(train_cfg, **train),
        logging=LoggingConfig(log_every=1, progress=False),
    )


def write_run_dir(root: Path, cfg: RunConfig) -> Path:
    """What the launcher would write, minus plan.json and the launch script (the worker reads neither)."""
    run_dir = root / cfg.name
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    return run_dir


def run_worker(run_dir: Path, nproc: int | None, entry: Path | None = None) -> subprocess.CompletedProcess:
    """N ranks of `-m trainctl.train RUN_DIR` (helpers.ranks_cmd: torchrun's environment without its agent), or a
    plain process when nproc is None.

    entry: a script to run instead of `-m trainctl.train` (a test wrapper around the worker).
    """
    program = [str(entry)] if entry is not None else ["-m", "trainctl.train"]
    if nproc is None:
        cmd = [sys.executable, *program, str(run_dir)]
    else:
        cmd = ranks_cmd(nproc, *program, str(run_dir))
    return run_group(cmd, WORKER_TIMEOUT_S, worker_env())


def train_and_check(root: Path, cfg: RunConfig, nproc: int | None, entry: Path | None = None) -> Path:
    run_dir = write_run_dir(root, cfg)
    check_worker(run_dir, run_worker(run_dir, nproc, entry))
    return run_dir


MANY_RUNS_WORKER = Path(__file__).with_name("many_runs_worker.py")


def check_worker(run_dir: Path, proc: subprocess.CompletedProcess) -> None:
    logs = "\n".join(p.read_text() for p in sorted((run_dir / "logs").glob("*.log")))
    stacks = "\n".join(f"--- {h.path.name}\n{h.path.read_text()[-1500:]}" for h in hangs.hangs(run_dir))
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}\n{logs[-4000:]}\n{stacks}"


def selected(request, key: str, names) -> list[str]:
    """`names` (in their order) that this module's selected tests take as the parametrize argument `key`: a module
    fixture that trains every case in shared launches trains only what the session runs (`-k` that picks a few
    cases, as the torch 2.11 tier does, does not pay for the rest)."""
    chosen = {params[key] for item in module_items(request) if key in (params := item_params(item))}
    return [name for name in names if name in chosen]


def runs_read(request, reads: dict[str, tuple[str, ...]]) -> set[str]:
    """The runs read by this module's selected tests that use the calling fixture. reads: test function -> the runs
    it reads, each a run's name or `{param}`, the run named by that parametrize argument (`("single", "{name}")`).
    A module fixture trains only these: cases the default run leaves to --full (tests/extended_tier.txt) or a -k
    selection do not pay for theirs."""
    names = set()
    for item in module_items(request):
        if request.fixturename in getattr(item, "fixturenames", ()):
            params = item_params(item)
            names.update(params[run[1:-1]] if run.startswith("{") else run for run in reads[item.originalname])
    return names


def selected_functions(request) -> set[str]:
    """The names of the test functions of this module that the session runs (each once, whatever its parameters):
    a module fixture whose runs serve different tests trains only the groups its selected tests read."""
    return {item.originalname for item in module_items(request)}


def module_items(request) -> list:
    """The tests of the calling fixture's module that this session runs (after -k, -m and the tier lists)."""
    return [item for item in request.session.items if item.module is request.module]


def item_params(item) -> dict:
    """A test's parametrize arguments ({} for one without)."""
    return getattr(getattr(item, "callspec", None), "params", {})


def train_many(root: Path, cases: dict[str, tuple[RunConfig, int | None]],
               entry: Path = MANY_RUNS_WORKER) -> dict[str, Path]:
    """Every case's run directory, trained: the cases of one world size in one start of its ranks (tests/
    dist/many_runs_worker.py, each run through the worker's own entry), the cases without ranks (None) in one plain
    process (a world of one, as the worker forms alone).

    cases: name -> (config, nproc); each run directory is root/NAME. A failure names the run that failed.
    entry: a script that takes several run directories as many_runs_worker.py does (a test wrapper around it).
    """
    run_dirs = {name: write_run_dir(root, replace(cfg, name=name)) for name, (cfg, _) in cases.items()}
    train_written({name: (run_dirs[name], nproc) for name, (_, nproc) in cases.items()}, entry)
    return run_dirs


def train_written(cases: dict[str, tuple[Path, int | None]], entry: Path = MANY_RUNS_WORKER) -> None:
    """train_many for run directories already written (name -> (run directory, nproc)), in this order."""
    by_world: dict[int | None, list[Path]] = {}
    for run_dir, nproc in cases.values():
        by_world.setdefault(nproc, []).append(run_dir)
    for nproc, run_dirs in by_world.items():
        program = [str(entry), *map(str, run_dirs)]
        cmd = [sys.executable, *program] if nproc is None else ranks_cmd(nproc, *program)
        proc = run_group(cmd, WORKER_TIMEOUT_S * len(run_dirs), worker_env())
        failed = [run_dir for run_dir in run_dirs if not (run_dir / "result.json").is_file()]
        check_worker(failed[0] if failed else run_dirs[-1], proc)


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def series(run_dir: Path, key: str) -> list[float]:
    return [r[key] for r in records(run_dir, "train")]


def assert_same_steps(run_dir: Path, reference: Path, key: str, steps: int, distinct: bool = True,
                      **shape: object) -> None:
    """`key` of every train step of `run_dir` equals the reference run's to rounding (tests.helpers.curve_rel, to
    which `shape` goes), over exactly `steps` steps; with `distinct`, the reference's values all differ (a constant
    series would match anything vacuously)."""
    got, want = series(run_dir, key), series(reference, key)
    assert len(got) == len(want) == steps
    assert not distinct or len(set(want)) == steps, f"{key}: the reference repeats values: {want}"
    assert_curve_close(got, want, key, **shape)


def assert_same_evals(run_dir: Path, reference: Path, **shape: object) -> None:
    """Every eval's val_loss equals the reference run's to rounding after as many steps (at least two evals)."""
    got, want = (records(run, "eval") for run in (run_dir, reference))
    assert len(got) == len(want) >= 2
    assert_curve_close([r["val_loss"] for r in got], [r["val_loss"] for r in want], "val_loss",
                       [r["step"] for r in want], **shape)
