"""The run records others share a runs folder with: FIFOs, huge or damaged files, odd names; runs/status/logs/plot."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hostile.common import Probe, case, expect, refused, succeeded, write_json

TINY = ["recipe=tiny_cpu", "train.steps=4", "schedule.warmup_steps=1"]


def dry_run(p: Probe, name: str = "r", *extra: str) -> Path:
    succeeded(p.cli("launch", *TINY, *extra, "--dry-run", "--name", name))
    return p.tmp / "runs" / name


def with_metrics(run_dir: Path, steps: int = 4, loss: float = 2.0) -> None:
    records = [{"kind": "train", "step": s, "loss": loss + 1 / s, "lr": 1e-3, "tokens_per_s": 100.0, "grad_norm": 1.0}
               for s in range(1, steps + 1)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def fifo_case(name: str):
    def check(p: Probe) -> None:
        run_dir = dry_run(p)
        target = run_dir / name
        if target.exists():
            target.unlink()
        os.mkfifo(target)
        for args in (["runs"], ["status", "r"], ["runs", "--json"]):
            r = p.cli(*args, timeout=30)
            if name == "config.yaml" and args[0] == "status":
                continue  # a run without a readable config may be named unknown; it must only not hang
            expect(r.code in (0, 2), "wrong", f"{' '.join(args)}: {r.brief()}")
        r = p.cli("cancel", "r", timeout=30)
        expect(r.code in (0, 2), "wrong", f"cancel: {r.brief()}")
    return check


for _name in ("config.yaml", "metrics.jsonl", "progress.json", "result.json", "launch.json", "trainer.json",
              "stopped.json", "trainer.lock"):
    case("records", f"a FIFO named {_name} in a run directory: runs, status, cancel")(fifo_case(_name))


@case("records", "a FIFO as a run's rank-0 log: logs")
def _(p: Probe) -> None:
    run_dir = dry_run(p)
    os.mkfifo(run_dir / "logs" / "rank0.log")
    r = p.cli("logs", "r", timeout=30)
    refused(r, "rank0.log")


@case("records", "a metrics.jsonl of one 200 MB line")
def _(p: Probe) -> None:
    run_dir = dry_run(p)
    with open(run_dir / "metrics.jsonl", "wb") as f:
        f.write(b'{"kind": "train", "step": 1, "loss": 1.0, "pad": "' + b"x" * (200 << 20) + b'"}\n')
    succeeded(p.cli("runs", timeout=30))
    succeeded(p.cli("status", "r", timeout=30))


@case("records", "a result.json of 300 MB")
def _(p: Probe) -> None:
    run_dir = dry_run(p)
    with open(run_dir / "result.json", "wb") as f:
        f.write(b'{"pad": "' + b"y" * (300 << 20) + b'"}')
    succeeded(p.cli("runs", timeout=30))


@case("records", "a result.json that is a list, and NaN and Infinity in metrics")
def _(p: Probe) -> None:
    run_dir = dry_run(p)
    (run_dir / "result.json").write_text("[1, 2]")
    lines = ['{"kind": "train", "step": 1, "loss": NaN}',
             '{"kind": "train", "step": 2, "loss": Infinity, "tokens_per_s": -Infinity}']
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    succeeded(p.cli("runs"))
    succeeded(p.cli("status", "r"))
    r = p.cli("runs", "--json")
    succeeded(r)
    json.loads(r.out)  # strict JSON for scripts: no NaN


@case("records", "status of a name with .. and of an absolute path outside runs")
def _(p: Probe) -> None:
    dry_run(p)
    refused(p.cli("status", "../../etc"), "../../etc")
    refused(p.cli("status", "/etc"), "/etc")


@case("records", "a symlink loop and a plain file among the runs")
def _(p: Probe) -> None:
    dry_run(p)
    (p.tmp / "runs" / "loop").symlink_to(p.tmp / "runs" / "loop")
    (p.tmp / "runs" / "notes.txt").write_text("mine")
    r = p.cli("runs")
    succeeded(r, "r")


@case("records", "cancel of a run whose trainer.json names pid 1")
def _(p: Probe) -> None:
    run_dir = dry_run(p)
    write_json(run_dir / "trainer.json", {"pid": 1, "host": os.uname().nodename, "pid_start": "x"})
    r = p.cli("cancel", "r")
    refused(r)


@case("records", "an empty TRAINCTL_RUNS_DIR: launch and runs agree on runs/")
def _(p: Probe) -> None:
    p.env["TRAINCTL_RUNS_DIR"] = ""
    succeeded(p.cli("launch", *TINY, "--dry-run", "--name", "here"))
    expect((p.tmp / "runs" / "here").is_dir(), "wrong", f"the run went to {sorted(os.listdir(p.tmp))}")
    succeeded(p.cli("runs"), "here")


@case("records", "a whitespace TRAINCTL_RUNS_DIR")
def _(p: Probe) -> None:
    p.env["TRAINCTL_RUNS_DIR"] = "  "
    r = p.cli("launch", *TINY, "--dry-run", "--name", "here")
    if r.code == 0:
        expect((p.tmp / "runs" / "here").is_dir(), "wrong", f"the run went to {sorted(os.listdir(p.tmp))}")
        succeeded(p.cli("runs"), "here")
    else:
        refused(r, "TRAINCTL_RUNS_DIR")


@case("records", "a run named sweeps")
def _(p: Probe) -> None:
    r = p.cli("launch", *TINY, "--dry-run", "--name", "sweeps")
    refused(r, "sweeps")


@case("records", "logs --follow of a run that never started")
def _(p: Probe) -> None:
    dry_run(p)
    refused(p.cli("logs", "r", "--follow", timeout=30))


@case("records", "logs --rank 99")
def _(p: Probe) -> None:
    dry_run(p)
    refused(p.cli("logs", "r", "--rank", "99"), "99")


@case("records", "plot --out into a subpath of a regular file")
def _(p: Probe) -> None:
    with_metrics(dry_run(p))
    (p.tmp / "f").write_text("mine")
    refused(p.cli("plot", "r", "--out", "f/plot.png"), "f/plot.png")
    expect((p.tmp / "f").read_text() == "mine", "data loss", "the file changed")


@case("records", "plot --out with an unsupported extension")
def _(p: Probe) -> None:
    with_metrics(dry_run(p))
    refused(p.cli("plot", "r", "--out", "curves.txt"), "curves.txt")


@case("records", "plot --out an existing folder writes and names a file in it")
def _(p: Probe) -> None:
    with_metrics(dry_run(p))
    (p.tmp / "pics").mkdir()
    r = p.cli("plot", "r", "--out", "pics")
    if r.code != 0:
        refused(r, "pics")
        return
    written = [line.split("wrote ", 1)[1].strip() for line in r.out.splitlines() if line.startswith("wrote ")]
    expect(len(written) == 1 and (p.tmp / written[0]).is_file(), "wrong", f"said {written}, which is not a file")


@case("records", "plot of a run without metrics")
def _(p: Probe) -> None:
    dry_run(p)
    refused(p.cli("plot", "r"))


@case("records", "runs over 300 run directories answers quickly")
def _(p: Probe) -> None:
    run_dir = dry_run(p)
    with_metrics(run_dir)
    for i in range(300):
        copy = p.tmp / "runs" / f"copy{i:03d}"
        copy.mkdir()
        for name in ("config.yaml", "metrics.jsonl"):
            (copy / name).write_bytes((run_dir / name).read_bytes())
    r = p.cli("runs", timeout=40)
    succeeded(r, "copy299")
