"""Sweeps: empty and duplicate grids, damaged records, rankings across unfinished points, interrupted creation."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from hostile.common import Probe, Verdict, case, expect, refused, succeeded, write_json

TINY = ["recipe=tiny_cpu", "train.steps=4", "schedule.warmup_steps=1"]


def dry_sweep(p: Probe, *grid: str, name: str = "sw") -> None:
    succeeded(p.cli("launch", "-m", *TINY, *grid, "--dry-run", "--name", name))


@case("sweeps", "a sweep that expands to no points")
def _(p: Probe) -> None:
    refused(p.cli("launch", "-m", *TINY, "optim.lr=range(0,0)", "--dry-run"))
    expect(not (p.tmp / "runs").exists(), "wrong", "something was written")


@case("sweeps", "a sweep with duplicate points")
def _(p: Probe) -> None:
    refused(p.cli("launch", "-m", *TINY, "optim.lr=1e-3,1e-3", "--dry-run"), "optim.lr")
    expect(not (p.tmp / "runs").exists(), "wrong", "something was written")


@case("sweeps", "a sweep whose points differ only in how a value is written (1e-3 and 0.001)")
def _(p: Probe) -> None:
    refused(p.cli("launch", "-m", *TINY, "optim.lr=1e-3,0.001", "--dry-run"), "optim.lr")


@case("sweeps", "a sweep.json that is not JSON: runs --sweep and plot --sweep")
def _(p: Probe) -> None:
    dry_sweep(p, "optim.lr=1e-3,2e-3")
    (p.tmp / "runs" / "sweeps" / "sw" / "sweep.json").write_text("{broken")
    refused(p.cli("runs", "--sweep", "sw"), "sweep.json")  # damaged, not "no sweep of that name"
    refused(p.cli("plot", "--sweep", "sw"), "sweep.json")


def shape_case(points):
    def check(p: Probe) -> None:
        dry_sweep(p, "optim.lr=1e-3,2e-3")
        write_json(p.tmp / "runs" / "sweeps" / "sw" / "sweep.json", {"name": "sw", "points": points})
        for args in (["runs", "--sweep", "sw"], ["plot", "--sweep", "sw"]):
            refused(p.cli(*args), "sweep.json")
    return check


for _label, _points in (("points is a string", "abc"), ("a point is a number", [1, 2]),
                        ("run_dir is a number", [{"index": 0, "run_dir": 5, "overrides": []}]),
                        ("overrides is a string", [{"index": 0, "run_dir": "x", "overrides": "lr=1"}]),
                        ("overrides hold numbers", [{"index": 0, "run_dir": "x", "overrides": [1, None]}])):
    case("sweeps", f"a sweep.json where {_label}")(shape_case(_points))


@case("sweeps", "runs --sweep ranks by one metric: a cancelled point's train loss is not compared with eval losses")
def _(p: Probe) -> None:
    dry_sweep(p, "optim.lr=1e-3,2e-3,3e-3")
    runs = p.tmp / "runs"
    for i, (val, train) in enumerate(((2.5, 2.4), (2.2, 2.1))):
        write_json(runs / f"sw-{i:02d}" / "result.json", {"final_val_loss": val, "final_train_loss": train,
                                                           "steps": 4})
    (runs / "sw-02" / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 2, "loss": 0.5}) + "\n")
    write_json(runs / "sw-02" / "stopped.json", {"step": 2, "signal": "SIGINT"})
    r = p.cli("runs", "--sweep", "sw", "--json")
    succeeded(r)
    rows = json.loads(r.out)
    order = [row["run"] for row in rows]
    expect(order == ["sw-01", "sw-00", "sw-02"], "wrong", f"ranked {order}: the unfinished point's train loss 0.5 "
           "beat finished points' eval losses" if order[0] == "sw-02" else f"ranked {order}")


@case("sweeps", "a point run directory named like another sweep's point")
def _(p: Probe) -> None:
    succeeded(p.cli("launch", *TINY, "--dry-run", "--name", "sw-00"))
    r = p.cli("launch", "-m", *TINY, "optim.lr=1e-3,2e-3", "--dry-run", "--name", "sw")
    if r.code == 2:
        refused(r, "sw")
        return
    record = json.loads((p.tmp / "runs" / "sweeps" / "sw" / "sweep.json").read_text())
    dirs = [pt["run_dir"] for pt in record["points"]]
    expect(str(p.tmp / "runs" / "sw-00") not in dirs, "wrong", "the sweep claims a run that is not its point")


@case("sweeps", "Ctrl-C while the point folders are written: all or nothing")
def _(p: Probe) -> None:
    values = ",".join(f"{1e-4 * (i + 1):.4g}" for i in range(120))
    argv = [sys.executable, "-m", "trainctl.cli", "launch", "-m", *TINY, f"optim.lr={values}", "--dry-run",
            "--name", "big"]
    proc = p.popen(argv)
    deadline = time.monotonic() + 180
    runs = p.tmp / "runs"
    while time.monotonic() < deadline and proc.poll() is None:
        if runs.is_dir() and sum(x.name.startswith("big-") for x in runs.iterdir()) >= 5:
            break  # a few points written, more to come
        time.sleep(0.01)
    if proc.poll() is not None:
        raise Verdict("wrong", "the sweep was written before it could be interrupted (harness timing)")
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    expect("Traceback" not in err, "traceback", err.strip().splitlines()[-1] if err.strip() else "")
    points = sorted(x.name for x in runs.iterdir() if x.name.startswith("big-")) if runs.is_dir() else []
    record = runs / "sweeps" / "big" / "sweep.json"
    whole = record.is_file() and len(json.loads(record.read_text()).get("points", [])) == 120 == len(points)
    expect(whole or (not points and not record.parent.exists()), "wrong",
           f"a partial sweep: {len(points)} point folders, record {'present' if record.exists() else 'absent'}, "
           f"sweep folder {'left' if record.parent.exists() else 'gone'}")
    if not whole:  # nothing was kept: the same command can be given again
        again = p.cli("launch", "-m", *TINY, "optim.lr=1e-3,2e-3", "--dry-run", "--name", "big")
        succeeded(again)


@case("sweeps", "interval() in a grid sweep")
def _(p: Probe) -> None:
    refused(p.cli("launch", "-m", *TINY, "optim.lr=interval(1e-4,1e-3)", "--dry-run"), "interval")


@case("sweeps", "a sweep across local and Slurm launchers")
def _(p: Probe) -> None:
    refused(p.cli("launch", "-m", *TINY, "cluster=local,slurm", "--dry-run"))


@case("sweeps", "a Slurm sweep dry run writes the array script")
def _(p: Probe) -> None:
    dry_sweep(p, "cluster=slurm", "optim.lr=1e-3,2e-3")
    expect((p.tmp / "runs" / "sweeps" / "sw" / "array.sh").is_file(), "wrong", "no array.sh")


@case("sweeps", "runs --sweep of a sweep that does not exist")
def _(p: Probe) -> None:
    refused(p.cli("runs", "--sweep", "nope"), "nope")
