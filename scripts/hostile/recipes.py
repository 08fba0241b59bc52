"""Recipes, config folders and overrides: escapes out of the declared folders, YAML bombs, broken files, odd values."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from hostile.common import Probe, Verdict, case, expect, nothing_left, refused, succeeded

SECRET = "secret_marker_4242"


def conf(p: Probe, files: dict[str, str]) -> Path:
    """A user config folder `myconf` with these files (paths relative to it)."""
    root = p.tmp / "myconf"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def outside_yaml(p: Probe) -> Path:
    """A YAML outside every declared folder: composing it in would show its marker."""
    path = p.tmp / "elsewhere" / "evil.yaml"
    path.parent.mkdir()
    path.write_text(f"# @package _global_\ndescription: {SECRET}\n")  # shows in `config show` wherever it loads
    return path


def no_escape(r) -> None:
    expect(SECRET not in r.out + r.err or r.code == 2, "escape", "a YAML outside the config folders was composed in")
    expect(r.code == 2, "escape" if SECRET in r.out else "wrong", r.brief())


def recipe_text(defaults: str) -> str:
    return f"# @package _global_\ndefaults:\n{defaults}\nrecipe: mine\n"


@case("recipes", "a recipe's defaults reaching out: override /model: ../../elsewhere/evil")
def _(p: Probe) -> None:
    outside_yaml(p)
    up = "../" * 12 + str(p.tmp.relative_to("/"))
    root = conf(p, {"recipes/mine.yaml": recipe_text(f"  - override /model: {up}/elsewhere/evil")})
    r = p.cli("config", "show", "--config-dir", root, "recipe=mine")
    no_escape(r)


@case("recipes", "a recipe file given by path whose defaults name an absolute YAML")
def _(p: Probe) -> None:
    evil = outside_yaml(p)
    (p.tmp / "mine.yaml").write_text(recipe_text(f"  - override /model: {evil.with_suffix('')}"))
    no_escape(p.cli("config", "show", f"recipe={p.tmp / 'mine.yaml'}"))


@case("recipes", "a group option file (model/x.yaml) with its own defaults reaching out")
def _(p: Probe) -> None:
    outside_yaml(p)
    root = conf(p, {"model/x.yaml": f"defaults:\n  - {'../' * 12}{p.tmp.relative_to('/')}/elsewhere/evil\n"
                                      "  - _self_\nname: x\n"})
    no_escape(p.cli("config", "show", "--config-dir", root, "model=x"))


@case("recipes", "a recipe naming /model@_global_ of an outside file")
def _(p: Probe) -> None:
    outside_yaml(p)
    root = conf(p, {"recipes/mine.yaml": recipe_text(f"  - /model@_global_: {'../' * 12}{p.tmp.relative_to('/')}"
                                                     "/elsewhere/evil")})
    no_escape(p.cli("config", "show", "--config-dir", root, "recipe=mine"))


def bomb(levels: int = 12) -> str:
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@case("recipes", "a billion-laughs recipe (nested YAML aliases)")
def _(p: Probe) -> None:
    root = conf(p, {"recipes/bomb.yaml": "# @package _global_\nrecipe: bomb\ndescription: x\n" + bomb()})
    refused(p.cli("plan", "--config-dir", root, "recipe=bomb", timeout=30), "bomb.yaml")


@case("recipes", "a billion-laughs config.yaml in a run directory: runs and status")
def _(p: Probe) -> None:
    succeeded(p.cli("launch", "recipe=tiny_cpu", "--dry-run", "--name", "r"))
    (p.tmp / "runs" / "r" / "config.yaml").write_text("train:\n  steps: 4\n" + bomb())
    for args in (["runs"], ["status", "r"]):
        r = p.cli(*args, timeout=30)
        expect(r.code in (0, 2), "wrong", r.brief())
    refused(p.cli("resume", "r", timeout=30), "config.yaml")


@case("recipes", "the temporary config overlay is removed when plan is stopped by SIGTERM")
def _(p: Probe) -> None:
    tmpdir = p.tmp / "tmpdir"
    tmpdir.mkdir()
    root = conf(p, {f"recipes/r{i}.yaml": f"# @package _global_\nrecipe: r{i}\n" for i in range(3000)})
    argv = [sys.executable, "-m", "trainctl.cli", "plan", "--config-dir", str(root), "recipe=r1"]
    # trainctl composes through a config source that writes no overlay folder now; whenever the signal lands
    # (starting up, listing 3000 recipe files, composing), $TMPDIR must hold nothing of trainctl's afterwards.
    stopped = 0
    for delay in (0.2, 0.6, 1.0):
        proc = p.popen(argv, env={"TMPDIR": str(tmpdir)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            stopped += 1
        proc.wait(timeout=60)
        left = list(tmpdir.glob("trainctl-*"))
        expect(not left, "wrong", f"left {left[0].name} in $TMPDIR (SIGTERM after {delay} s)" if left else "")
    expect(stopped > 0, "wrong", "plan ended before any SIGTERM could land (harness timing)")


@case("recipes", "a YAML syntax error in a user recipe names the file, line and column")
def _(p: Probe) -> None:
    root = conf(p, {"recipes/bad.yaml": "# @package _global_\nrecipe: bad\ntrain:\n  steps: [1, 2\n  seq_len: 3\n"})
    r = p.cli("plan", "--config-dir", root, "recipe=bad")
    refused(r, "bad.yaml")
    expect(re.search(r"bad\.yaml(:5:\d+|, line 5)", r.err) is not None, "wrong", f"no line 5 named: {r.err[:200]}")


@case("recipes", "a !!python/object tag in a user recipe")
def _(p: Probe) -> None:
    root = conf(p, {"recipes/tag.yaml": "# @package _global_\nrecipe: !!python/object/apply:os.system ['true']\n"})
    refused(p.cli("plan", "--config-dir", root, "recipe=tag"), "tag.yaml")


@case("recipes", "a recipe that includes itself")
def _(p: Probe) -> None:
    root = conf(p, {"recipes/loop.yaml": recipe_text("  - /recipe: loop")})
    refused(p.cli("plan", "--config-dir", root, "recipe=loop", timeout=30), "loop")


@case("recipes", "two recipes including each other")
def _(p: Probe) -> None:
    root = conf(p, {"recipes/a.yaml": recipe_text("  - /recipe: b"), "recipes/b.yaml": recipe_text("  - /recipe: a")})
    refused(p.cli("plan", "--config-dir", root, "recipe=a", timeout=30))


@case("recipes", "an empty recipe file and a recipe that is a YAML list")
def _(p: Probe) -> None:
    root = conf(p, {"recipes/empty.yaml": "", "recipes/alist.yaml": "- 1\n- 2\n"})
    r = p.cli("plan", "--config-dir", root, "recipe=empty")
    succeeded(r) if r.code == 0 else refused(r, "empty")
    refused(p.cli("plan", "--config-dir", root, "recipe=alist"), "alist")


@case("recipes", "an option file that is a dangling symlink, and one that is a FIFO")
def _(p: Probe) -> None:
    root = conf(p, {})
    (root / "model").mkdir(parents=True)
    (root / "model" / "gone.yaml").symlink_to(p.tmp / "nowhere.yaml")
    os.mkfifo(root / "model" / "pipe.yaml")
    for option in ("gone", "pipe"):
        r = p.cli("plan", "--config-dir", root, f"model={option}", timeout=30)
        refused(r, option)
    succeeded(p.cli("recipes", "--config-dir", root, timeout=30))


@case("recipes", "an override value nested 10000 lists deep")
def _(p: Probe) -> None:
    refused(p.cli("plan", "recipe=tiny_cpu", "train.steps=" + "[" * 10000 + "]" * 10000, timeout=60), "train.steps")


@case("recipes", "an override map nested 5000 deep")
def _(p: Probe) -> None:
    refused(p.cli("plan", "recipe=tiny_cpu", "+x=" + "{a:" * 5000 + "1" + "}" * 5000, timeout=60))


@case("recipes", "an override key of 5000 characters")
def _(p: Probe) -> None:
    refused(p.cli("plan", "recipe=tiny_cpu", "a" * 5000 + "=1"))
    refused(p.cli("plan", "recipe=tiny_cpu", "+" + "b" * 5000 + "=1"))
    refused(p.cli("plan", "recipe=tiny_cpu", "model=" + "c" * 5000), "model")


@case("recipes", "an override value of 100 KB")
def _(p: Probe) -> None:
    # 1 MB does not fit in one argv string on Linux (MAX_ARG_STRLEN is 128 KiB): the OS refuses before trainctl.
    r = p.cli("plan", "recipe=tiny_cpu", "logging.wandb.project=" + "p" * 100_000)
    succeeded(r) if r.code == 0 else refused(r, "logging.wandb.project")


@case("recipes", "train.seed=1e23 and a seed past 2**64")
def _(p: Probe) -> None:
    refused(p.cli("plan", "recipe=tiny_cpu", "train.seed=1e23"), "train.seed")
    refused(p.cli("plan", "recipe=tiny_cpu", f"train.seed={2**64 + 1}"), "train.seed")


@case("recipes", "train.steps=1e3 (a float for an int)")
def _(p: Probe) -> None:
    r = p.cli("plan", "recipe=tiny_cpu", "train.steps=1e3")
    refused(r, "train.steps")


@case("recipes", "NUL and newline characters in an override")
def _(p: Probe) -> None:
    refused(p.cli("plan", "recipe=tiny_cpu", "name=a\nb"), "name")
    r = p.cli("launch", "recipe=tiny_cpu", "logging.wandb.project=x\ny", "--dry-run")
    if r.code == 0:
        text = (p.tmp / "runs").rglob("launch.sh").__next__().read_text()
        expect("\ny\n" not in text, "escape", "an override's newline reached the launch script")
    else:
        refused(r)


@case("recipes", "shell metacharacters in values that land in the launch script")
def _(p: Probe) -> None:
    evil = "$(touch pwned)`touch pwned2`;touch pwned3"
    r = p.cli("launch", "recipe=tiny_cpu", "cluster=slurm", f"cluster.partition={evil}", f"cluster.env.X={evil}",
              "--dry-run", "--name", "s")
    if r.code == 0:
        script = p.tmp / "runs" / "s" / "launch.sh"
        check = p.run(["bash", "-n", str(script)])
        expect(check.code == 0, "wrong", "the script no longer parses")
    else:
        refused(r, one_line=False)
    expect(not any(p.tmp.glob("pwned*")), "escape", "a value ran a command")


@case("recipes", "cluster.gpu=h100 with cluster=local on a machine without a GPU")
def _(p: Probe) -> None:
    if Path("/dev/nvidia0").exists():
        raise Verdict("wrong", "this machine has an NVIDIA GPU: the case needs one without")
    r = p.cli("plan", "recipe=tiny_cpu", "cluster.gpu=h100", "cluster.device=cuda")
    succeeded(r)
    expect("gpu" in r.err.lower() or "warning" in (r.out + r.err).lower(), "wrong", "the plan says nothing of it")
    before = p.files()
    refused(p.cli("launch", "recipe=tiny_cpu", "cluster.gpu=h100", "cluster.device=cuda"), "cluster")
    nothing_left(p, before)


@case("recipes", "a plan that does not fit suggests more GPUs or nodes")
def _(p: Probe) -> None:
    r = p.cli("plan", "recipe=llama7b_fsdp", "data=synthetic", "train.activation_checkpointing=none",
              "train.micro_batch=8", "train.grad_accum=-1", "cluster.nodes=1")
    succeeded(r)
    expect("cluster.nodes=" in r.out or "procs_per_node=" in r.out, "wrong", "no advice to add GPUs or nodes")


@case("recipes", "hydra.* overrides and group options given as paths")
def _(p: Probe) -> None:
    for item in ("hydra.searchpath=[file:///etc]", "model=/etc/passwd", "+recipe@_global_=../../x", "recipe="):
        refused(p.cli("plan", item), item.split("=")[0].lstrip("+").split("@")[0])


@case("recipes", "--config-dir that is a file, and a TRAINCTL_CONFIG_PATH folder that does not exist")
def _(p: Probe) -> None:
    (p.tmp / "afile").write_text("x")
    refused(p.cli("plan", "--config-dir", "afile", "recipe=tiny_cpu"), "afile")
    p.env["TRAINCTL_CONFIG_PATH"] = str(p.tmp / "nope")
    refused(p.cli("plan", "recipe=tiny_cpu"), "nope")


@case("recipes", "an interpolation reading the environment in a value")
def _(p: Probe) -> None:
    p.env["SECRET_TOKEN"] = SECRET
    r = p.cli("launch", "recipe=tiny_cpu", "logging.wandb.project=${oc.env:SECRET_TOKEN}", "--dry-run", "--name", "i")
    if r.code != 0:
        refused(r)
        return
    text = (p.tmp / "runs" / "i" / "config.yaml").read_text()
    expect(SECRET in text or "oc.env" in text, "wrong", "the value vanished")


@case("recipes", "a recipe with a unicode name and one with a space")
def _(p: Probe) -> None:
    root = conf(p, {"recipes/ünï.yaml": "# @package _global_\nrecipe: x\n", "recipes/a b.yaml": "recipe: y\n"})
    r = p.cli("recipes", "--config-dir", root)
    succeeded(r)
    refused(p.cli("plan", "--config-dir", root, "recipe=ünï"))
