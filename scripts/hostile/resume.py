"""Resume and launch: hand-edited configs, finished runs, extending, dry runs checked like launches, odd folders."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from hostile.common import Probe, case, expect, nothing_left, refused, succeeded

RUN = ["recipe=tiny_cpu", "train.steps=4", "train.eval_every=0", "schedule.warmup_steps=1", "cluster.procs_per_node=1",
       "sharding=none", "model.dim=64", "model.n_layers=1", "model.n_heads=4", "model.n_kv_heads=2",
       "model.ffn_dim=176", "train.seq_len=32", "train.global_batch=2", "train.micro_batch=2", "train.grad_accum=-1",
       "logging.progress=false"]


def dry(p: Probe, *extra: str, name: str = "r", cwd: Path | None = None) -> Path:
    succeeded(p.cli("launch", *RUN, *extra, "--dry-run", "--name", name, cwd=cwd))
    return (cwd or p.tmp) / "runs" / name


def trained(p: Probe, *extra: str) -> Path:
    succeeded(p.cli("launch", *RUN, *extra, "--name", "r", timeout=180))
    return p.tmp / "runs" / "r"


def edit_config(run_dir: Path, old: str, new: str) -> None:
    text = (run_dir / "config.yaml").read_text()
    assert old in text, old
    (run_dir / "config.yaml").write_text(text.replace(old, new))


@case("resume", "resume of a hand-edited config.yaml (n_kv_heads that does not divide n_heads)")
def _(p: Probe) -> None:
    run_dir = dry(p)
    edit_config(run_dir, "n_kv_heads: 2", "n_kv_heads: 3")
    refused(p.cli("resume", "r"), "config.yaml", "n_kv_heads")
    expect(not (run_dir / "launch.json").exists(), "wrong", "it launched")


@case("resume", "resume of a config.yaml edited to a wrong type")
def _(p: Probe) -> None:
    run_dir = dry(p)
    edit_config(run_dir, "steps: 4", "steps: many")
    refused(p.cli("resume", "r"), "config.yaml", "steps")


@case("resume", "resume of a config.yaml that is not YAML")
def _(p: Probe) -> None:
    run_dir = dry(p)
    (run_dir / "config.yaml").write_text("train: [unclosed\n")
    refused(p.cli("resume", "r"), "config.yaml")


@case("resume", "resume of a run that is not there")
def _(p: Probe) -> None:
    refused(p.cli("resume", "ghost"), "ghost")


@case("resume", "resume while another process holds the run's lock")
def _(p: Probe) -> None:
    run_dir = dry(p)
    fd = os.open(run_dir / "trainer.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        refused(p.cli("resume", "r"), "r")
    finally:
        os.close(fd)


@case("resume", "resume with keys that would make it another run")
def _(p: Probe) -> None:
    dry(p)
    for item, key in (("model.dim=32", "model.dim"), ("train.seq_len=16", "train.seq_len"),
                      ("model=llama2_7b", "model"), ("data=synthetic", "data")):
        refused(p.cli("resume", "r", item), key)


@case("resume", "resume with a bad override (unknown key, wrong type, sweep)")
def _(p: Probe) -> None:
    dry(p)
    refused(p.cli("resume", "r", "train.nope=1"), "train.nope")
    refused(p.cli("resume", "r", "optim.lr=fast"), "optim.lr")
    refused(p.cli("resume", "r", "optim.lr=1e-3,1e-4"), "optim.lr")


@case("resume", "resume from a working directory whose path contains RUN_DIR", slow=True)
def _(p: Probe) -> None:
    work = p.tmp / "my RUN_DIR work"
    work.mkdir()
    (work / "notes").mkdir()
    run_dir = dry(p, "data.cache_dir=cache", cwd=work)  # a relative path, meant from `work`
    succeeded(p.cli("resume", str(run_dir), timeout=180))
    expect((work / "cache").is_dir(), "wrong", f"the workers did not start in {work.name}")
    expect(not (p.tmp / "cache").exists(), "wrong", "the workers started elsewhere")


@case("resume", "resume of a finished run without more steps")
def _(p: Probe) -> None:
    run_dir = dry(p)
    (run_dir / "result.json").write_text(json.dumps({"steps": 4}))
    refused(p.cli("resume", "r"), "train.steps")


@case("resume", "bash launch.sh of a finished run keeps its result.json")
def _(p: Probe) -> None:
    run_dir = dry(p)
    (run_dir / "result.json").write_text(json.dumps({"steps": 4, "final_train_loss": 1.25}))
    before = p.files()
    r = p.run(["bash", str(run_dir / "launch.sh")], timeout=120)
    expect(r.code == 0, "wrong", r.brief())
    after = p.files()
    key = "runs/r/result.json"
    expect(after.get(key) == before[key], "data loss", "result.json was rewritten")
    expect(not (run_dir / "logs" / "torchrun").exists(), "wrong", "it trained again")


@case("resume", "extend a finished run: resume NAME train.steps=6", slow=True)
def _(p: Probe) -> None:
    run_dir = trained(p)
    first = (run_dir / "result.json").read_text()
    r = p.cli("resume", "r", "train.steps=6", timeout=180)
    succeeded(r, "schedule")
    result = json.loads((run_dir / "result.json").read_text())
    expect(result.get("steps") == 6 and result.get("resumed_from_step") == 4, "wrong", f"result {result}")
    kept = [x.read_text() for x in (run_dir / "history").glob("*result.json")] if (run_dir / "history").is_dir() else []
    expect(first in kept, "data loss", "the first result is gone")


@case("resume", "resume NAME train.steps below the newest checkpoint", slow=True)
def _(p: Probe) -> None:
    run_dir = trained(p)
    (run_dir / "result.json").unlink()  # as if it stopped at its last step without a result
    refused(p.cli("resume", "r", "train.steps=2"), "train.steps")


@case("launch", "launch --dry-run with W&B online and no credentials")
def _(p: Probe) -> None:
    before = p.files()
    refused(p.cli("launch", *RUN, "logging.wandb.mode=online", "--dry-run"), "wandb")
    nothing_left(p, before, p.tmp / "runs")


@case("launch", "launch --dry-run with missing token files")
def _(p: Probe) -> None:
    refused(p.cli("launch", *RUN, "data=memmap", "data.train_path=a.bin", "data.val_path=b.bin", "--dry-run"),
            "a.bin", "b.bin", one_line=False)
    expect(not (p.tmp / "runs").exists(), "wrong", "a run directory was written")


@case("launch", "launch --dry-run of a layout the worker cannot run (zero1 with tp)")
def _(p: Probe) -> None:
    r = p.cli("launch", "recipe=tiny_cpu", "sharding=zero1", "sharding.tp=2", "cluster.procs_per_node=4",
              "--dry-run")
    refused(r, "zero1")
    expect(not (p.tmp / "runs").exists(), "wrong", "a run directory was written")


@case("launch", "launch --dry-run of a Slurm run says sbatch, not bash")
def _(p: Probe) -> None:
    r = p.cli("launch", *RUN, "cluster=slurm", "--dry-run", "--name", "s")
    succeeded(r, f"sbatch {p.tmp / 'runs' / 's' / 'launch.sh'}")


@case("launch", "a deleted working directory")
def _(p: Probe) -> None:
    gone = p.tmp / "gone"
    gone.mkdir()
    script = f'cd "{gone}" && rmdir "{gone}" && exec "$0" -m trainctl.cli plan recipe=tiny_cpu'
    r = p.run(["bash", "-c", script, __import__("sys").executable])
    refused(r, "working directory")


@case("launch", "a run directory that cannot be written")
def _(p: Probe) -> None:
    (p.tmp / "ro").write_text("a file where runs_dir should be a folder")
    refused(p.cli("launch", *RUN, "runs_dir=ro/runs", "--dry-run"), "runs_dir")
