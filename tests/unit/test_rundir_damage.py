"""Property-style: random bytes and random JSON values in every run-directory file never make the CLI raise.

`runs`, `status`, `logs` and `resume` read what a run directory holds; whatever a crash, a full disk or a
careless edit left there, they answer (a state, a one-line error) without a traceback, and one damaged run
never hides the others.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from tests.helpers import cli_in_process
from trainctl.config.schema import ClusterConfig, RunConfig, TrainConfig
from trainctl.core import rundir as layout
from trainctl.launch import rundir
from trainctl.launch.backends.local import launcher as local
from trainctl.plan.runplan import build

FILES = [
    layout.CONFIG, layout.PLAN, layout.LAUNCH, layout.METRICS, layout.RESULT, layout.STOPPED, layout.HOLDER,
    layout.ATTEMPTS, layout.WANDB_ID, layout.SCRIPT, "checkpoints/step-00000004/manifest.json",
    "checkpoints/step-00000004/meta.json", "logs/rank0.log",
]
KEYS = ["launcher", "job_id", "pid", "pid_start", "host", "exit_code", "state", "failure", "run_dir", "step", "kind",
        "loss", "signal", "time", "files", "rank", "message", "memory", "peak_bytes", "mfu", "assumed_mfu", "device"]


def random_json(rng: random.Random, depth: int = 0):
    choices = [None, True, False, 0, -1, 2**70, 1.5, float("nan"), float("inf"), "", "x" * 300, "SIGINT", "local",
               "slurm", "\x00\n${a}", "step-00000004", "/nonexistent", str(Path.home())]
    kind = rng.randrange(4 if depth < 3 else 1)
    if kind == 0:
        return rng.choice(choices)
    if kind == 1:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(KEYS): random_json(rng, depth + 1) for _ in range(rng.randrange(6))}


def damage(rng: random.Random) -> bytes:
    """Random bytes, a random JSON value, JSON lines of random values, or a truncated real-looking record."""
    kind = rng.randrange(4)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(200)))
    if kind == 1:
        return json.dumps(random_json(rng)).encode()
    if kind == 2:
        return b"".join(json.dumps(random_json(rng)).encode() + b"\n" for _ in range(rng.randrange(1, 5)))
    record = json.dumps({"kind": "train", "step": 3, "loss": 1.0, "launcher": "local", "pid": 1, "exit_code": 1})
    return record[: rng.randrange(len(record))].encode()


def cfg() -> RunConfig:
    return RunConfig(recipe="tiny_cpu", cluster=ClusterConfig(launcher="local", procs_per_node=1),
                     train=TrainConfig(steps=8, seq_len=32, global_batch=2, micro_batch=2, grad_accum=1))


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("template")
    config = cfg()
    run_dir = rundir.create(config, build(config), root / "runs", "template", [], workdir=root)
    ckpt = run_dir / "checkpoints" / "step-00000004"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text('{"step": 4}')
    (ckpt / "manifest.json").write_text(json.dumps({"files": {"meta.json": {"size": 11, "sha256": "0" * 64}}}))
    (run_dir / layout.METRICS).write_text('{"kind": "train", "step": 1, "loss": 2.0}\n')
    return run_dir


def cli_answers(monkeypatch, capsysbinary, *argv: str) -> tuple[int, str]:
    """Run the console entry in this process; a traceback would propagate and fail the test."""
    code, out, err = cli_in_process(monkeypatch, capsysbinary, *argv)
    return code, out + err


# One seed in the unit tier; the other five (~2 s each: 40 CLI answers over damaged copies) in the fuzz tier.
@pytest.mark.parametrize("seed", [0, *(pytest.param(seed, marks=pytest.mark.fuzz) for seed in range(1, 6))])
def test_damaged_files_never_raise(tmp_path, template, monkeypatch, capsysbinary, seed):
    rng = random.Random(seed)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))  # Slurm clients absent: the records must answer
    launched = []
    monkeypatch.setattr(local, "run", lambda run_dir, **kw: launched.append(run_dir) or 0)
    runs_dir = tmp_path / "runs"
    names = []
    for target in FILES:
        name = f"r{len(names)}"
        run_dir = runs_dir / name
        shutil.copytree(template, run_dir)
        (run_dir / target).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / target).write_bytes(damage(rng))
        names.append(name)
    healthy = runs_dir / "healthy"
    shutil.copytree(template, healthy)

    code, text = cli_answers(monkeypatch, capsysbinary, "runs", "--runs-dir", str(runs_dir))
    assert code == 0, text
    assert "healthy" in text, "one damaged run hid the others"
    for name in names:
        assert name in text, f"run {name} disappeared from the table"
    for name in names:
        for command in (["status", name], ["logs", name], ["resume", name]):
            code, text = cli_answers(monkeypatch, capsysbinary, *command, "--runs-dir", str(runs_dir))
            assert code in (0, 2), f"{command}: exit {code}\n{text}"
            assert "Traceback" not in text
            if code == 2:
                assert text.count("error:") >= 1


def test_a_damaged_config_is_one_line_on_resume(tmp_path, template, monkeypatch, capsysbinary):
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "runs" / "broken"
    shutil.copytree(template, run_dir)
    (run_dir / layout.CONFIG).write_text("train: [unclosed\n")
    code, text = cli_answers(monkeypatch, capsysbinary, "resume", "broken", "--runs-dir", str(tmp_path / "runs"))
    assert code == 2 and "config.yaml does not load" in text and len(text.strip().splitlines()) == 1, text


def test_readers_survive_wrong_shapes(tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    for value in ([1, 2], "text", 3, None, {"step": "seven"}, {"kind": "train", "step": True}):
        (run_dir / layout.LAUNCH).write_text(json.dumps(value))
        (run_dir / layout.METRICS).write_text(json.dumps(value) + "\n")
        assert isinstance(layout.launch_record(run_dir), dict)
        assert layout.last_train_record(run_dir) == {}
    (run_dir / layout.METRICS).write_bytes(b"\xff\xfe\n{\"kind\": \"train\", \"step\": 2}\n")
    assert layout.last_train_record(run_dir) == {"kind": "train", "step": 2}


def test_each_step_once_after_a_resume():
    records = [{"kind": "train", "step": s, "loss": float(s)} for s in (1, 2, 3, 4, 5)]
    records += [{"kind": "resume", "step": 3}] + [{"kind": "train", "step": s, "loss": -float(s)} for s in (4, 5, 6)]
    got = layout.latest_per_step(records, "train")
    assert [(r["step"], r["loss"]) for r in got] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, -4.0), (5, -5.0), (6, -6.0)]
    # A resume that went back further drops what the superseded attempt logged past it.
    rewound = records + [{"kind": "train", "step": 2, "loss": 0.5}]
    assert [r["step"] for r in layout.latest_per_step(rewound, "train")] == [1, 2]
