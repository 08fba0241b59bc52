"""The Python API given wrong types, inputs that used to end in a traceback, and answers that were wrong or
misleading (issue 35): each must be one clear line (exit 2 from the CLI, one UserError from the API)."""

from __future__ import annotations

import json
import os
import sys

from hostile.common import Probe, case, expect, nothing_left, refused, succeeded

TINY = ["recipe=tiny_cpu"]
CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}

# An API call in a fresh interpreter: its UserError printed as the CLI prints one (so `refused` judges it), any
# other exception left to end in a traceback.
API_CALL = """
import sys
from trainctl import api
from trainctl.core.errors import UserError
try:
    result = {call}
except UserError as exc:
    print("\\n".join("error: " + line for line in exc.problems), file=sys.stderr)
    sys.exit(2)
print("returned", repr(result)[:150])
"""


def api_refuses(call: str, *words: str):
    def check(p: Probe) -> None:
        before = p.files()
        refused(p.python(API_CALL.format(call=call)), *words)
        nothing_left(p, before)

    return check


for _call, _words in [
    ("api.plan(['recipe=tiny_cpu'], config_dirs=5)", ("config_dirs=5", "expected")),
    ("api.launch(['recipe=tiny_cpu', 'runs_dir=r'], name=5, dry_run=True)", ("name=5", "a string")),
    ("api.runs(runs_dir=5)", ("runs_dir=5", "a path or a string")),
    ("api.prepare_data(['in.txt'], 'out', workers='2')", ("workers='2'", "an int")),
    ("api.tune(['recipe=tiny_cpu'], top='4')", ("top='4'", "an int")),
    ("api.launch(['recipe=tiny_cpu', 'runs_dir=r'], dry_run='no')", ("dry_run='no'", "True or False")),
    ("api.prepare_data('in.jsonl', 'out')", ("inputs='in.jsonl'", "not one string")),
    ("api.plot('run-a')", ("runs='run-a'", "not one string")),
    ("api.generate('run', max_new_tokens='8')", ("max_new_tokens='8'", "an int")),
    ("api.export('run', dtyp='bf16')", ("dtyp='bf16'", "not an option of api.export")),
    ("api.status('run', 'runs', 'extra')", ("too many positional arguments",)),
]:
    case("api", f"{_call}")(api_refuses(_call, *_words))


@case("api", "api.runs(runs_dir=FILE) is one line, not an empty table")
def _(p: Probe) -> None:
    (p.tmp / "afile").write_text("")
    refused(p.python(API_CALL.format(call="api.runs(runs_dir='afile')")), "afile", "a file, not a folder of runs")


# ---------------------------------------------------------------- inputs that were tracebacks


def chat_prepare(p: Probe, template: str):
    (p.tmp / "chat.jsonl").write_text(json.dumps(CHAT) + "\n")
    (p.tmp / "t.jinja").write_text(template)
    return p.cli("data", "prepare", "chat.jsonl", "--format", "chat", "--chat-template", "t.jinja", "--out", "ds",
                 "--workers", "1")


for _name, _template, _words in [
    ("divides by zero", "{{ 1 // 0 }}", ("chat template", "ZeroDivisionError")),
    ("recurses", "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", ("chat template", "RecursionError")),
    ("sums strings", "{{ messages | map(attribute='role') | sum }}", ("chat template", "TypeError")),
    ("nests 5000 parentheses", "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", ("nests too deeply",)),
]:
    def _check(p: Probe, template=_template, words=_words) -> None:
        refused(chat_prepare(p, template), *words)
        expect(not (p.tmp / "ds").exists(), "wrong", "left the dataset folder behind")

    case("edges", f"a chat template that {_name}")(_check)


@case("edges", "a JSON line nested 200,000 deep (text and chat)")
def _(p: Probe) -> None:
    deep = 200_000
    (p.tmp / "text.jsonl").write_text('{"text": ' + "[" * deep + "]" * deep + "}\n")
    refused(p.cli("data", "prepare", "text.jsonl", "--out", "a", "--workers", "1"), "byte 0", "nested deeper")
    (p.tmp / "chat.jsonl").write_text("[" * deep + "]" * deep + "\n")
    refused(p.cli("data", "prepare", "chat.jsonl", "--format", "chat", "--chat-template", "chatml", "--out", "b",
                  "--workers", "1"), "byte 0", "nested deeper")


@case("edges", "an input folder holding an entry that cannot be read (a path past PATH_MAX)")
def _(p: Probe) -> None:
    folder = p.tmp / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("hello world\n" * 20)
    fd = os.open(folder, os.O_RDONLY)
    try:  # each component relative to the last: the whole path is longer than the system takes
        for _ in range(4096 // 200 + 1):
            os.mkdir("d" * 200, dir_fd=fd)
            fd, old = os.open("d" * 200, os.O_RDONLY, dir_fd=fd), fd
            os.close(old)
        os.close(os.open("deep.txt", os.O_WRONLY | os.O_CREAT, dir_fd=fd))
    finally:
        os.close(fd)
    refused(p.cli("data", "prepare", "docs", "--out", "ds", "--workers", "1"), "cannot be read", "too long")


# ---------------------------------------------------------------- wrong or misleading


@case("edges", "train.hang_timeout_s=1e12 (the worker's timer overflowed)")
def _(p: Probe) -> None:
    refused(p.cli("plan", *TINY, "train.hang_timeout_s=1e12"), "train.hang_timeout_s", "2592000")


@case("edges", "model.lora.rank=100000 on a 256-wide model")
def _(p: Probe) -> None:
    refused(p.cli("plan", *TINY, "model.lora.rank=100000"), "model.lora.rank=100000", "at most 128")


@case("edges", "LoRA on a random frozen base warns in a dry run")
def _(p: Probe) -> None:
    r = p.cli("launch", "--dry-run", *TINY, "model.lora.rank=8", "runs_dir=r")
    succeeded(r)
    expect("random base" in r.out + r.err, "wrong", "no warning that the frozen base is random")


@case("edges", "trainctl runs with TRAINCTL_RUNS_DIR=FILE and --runs-dir FILE")
def _(p: Probe) -> None:
    (p.tmp / "afile").write_text("")
    refused(p.cli("runs", env={"TRAINCTL_RUNS_DIR": "afile"}), "afile", "a file, not a folder of runs")
    refused(p.cli("runs", "--runs-dir", "afile"), "afile", "a file, not a folder of runs")


@case("edges", "a local dry run into a runs_dir with a space (only Slurm cannot take it)")
def _(p: Probe) -> None:
    succeeded(p.cli("launch", "--dry-run", *TINY, "runs_dir=my runs", "name=x"))
    expect((p.tmp / "my runs" / "x" / "launch.sh").is_file(), "wrong", "no launch.sh under 'my runs'")


@case("edges", "a Slurm dry run from a spaced folder with a relative runs_dir")
def _(p: Probe) -> None:
    spaced = p.tmp / "my work"
    spaced.mkdir()
    refused(p.cli("launch", "--dry-run", *TINY, "cluster=slurm", cwd=spaced), "runs_dir", "#SBATCH",
            "cluster=local takes any path")
    expect(list(spaced.iterdir()) == [], "wrong", "left something in the spaced folder")


@case("edges", "resume with a changed model.lora.rank suggests what works")
def _(p: Probe) -> None:
    succeeded(p.cli("launch", "--dry-run", *TINY, "model.lora.rank=8", "runs_dir=r", "name=l"))
    r = p.cli("resume", "l", "--runs-dir", "r", "model.lora.rank=4")
    refused(r, "model.lora", "--merged", "checkpoint.init_from", absent=("checkpoint.resume=RUN_DIR",))


@case("edges", "a prepared chat set whose every loss mask is empty is refused before a launch")
def _(p: Probe) -> None:
    lines = [json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                      {"role": "assistant", "content": f"a{i}"}]}) for i in range(40)]
    (p.tmp / "c.jsonl").write_text("\n".join(lines) + "\n")
    succeeded(p.cli("data", "prepare", "c.jsonl", "--format", "chat", "--chat-template", "chatml", "--out", "ds",
                    "--workers", "1", "--val-fraction", "0.3"))
    meta = json.loads((p.tmp / "ds" / "meta.json").read_text())
    for shard in meta["splits"]["train"]["shards"]:  # the masks as a set without answers has them
        mask = p.tmp / "ds" / shard["mask"]
        mask.write_bytes(bytes(b & ~1 for b in mask.read_bytes()))
    meta["splits"]["train"]["loss_tokens"] = 0
    (p.tmp / "ds" / "meta.json").write_text(json.dumps(meta))
    refused(p.cli("plan", *TINY, "data=memmap", f"data.datasets=[{p.tmp / 'ds'}]", "train.seq_len=16"),
            "no train token counts in the loss", one_line=False)


# ---------------------------------------------------------------- with a worker (slow)

ONE_STEP = [*TINY, "train.steps=1", "schedule.warmup_steps=0", "cluster.procs_per_node=1", "train.eval_every=0",
            "runs_dir=r", "name=one"]


@case("edges", "generate --prompts FILE whose line 2 does not fit the context answers every line", slow=True)
def _(p: Probe) -> None:
    succeeded(p.cli("launch", *ONE_STEP, timeout=300))
    (p.tmp / "prompts.txt").write_text("hello there\n" + "x" * 5000 + "\nbye\n")
    r = p.cli("generate", "one", "--runs-dir", "r", "--prompts", "prompts.txt", "--max-new-tokens", "3", timeout=300)
    expect(r.code == 1, "wrong", f"exit {r.code} (1: a line was not answered): {r.brief()}")
    answers = [json.loads(line) for line in r.out.splitlines() if line.strip()]
    expect([a["prompt"][:5] for a in answers] == ["hello", "xxxxx", "bye"], "wrong",
           f"{len(answers)} answers for 3 lines")
    expect("line 2" in answers[1].get("error", "") and "error" not in answers[0], "wrong",
           f"line 2's answer does not say why: {str(answers[1])[-160:]}")


@case("edges", "a run whose writes pass the file size limit (ulimit -f: the data cache, a checkpoint) says so",
      slow=True)
def _(p: Probe) -> None:
    argv = ["bash", "-c", 'ulimit -f 4096 && exec "$0" -m trainctl.cli launch "$@"', sys.executable, *ONE_STEP]
    r = p.run(argv, timeout=300)
    expect(r.code not in (0, None), "wrong", f"exit {r.code} with a 4 MiB file size limit")
    text = r.out + r.err
    expect("file size limit" in text and "unexpected pos" not in text, "wrong",
           f"does not name the limit: {[line for line in text.splitlines() if 'checkpoint' in line][-1:]}")


@case("edges", "QLoRA (model.lora.base_dtype=nf4) without adapters, misspelled, or on a width NF4's blocks split")
def _(p: Probe) -> None:
    refused(p.cli("plan", *TINY, "model.lora.base_dtype=nf4"), "model.lora.base_dtype=nf4", "model.lora.rank")
    refused(p.cli("plan", *TINY, "model.lora.rank=8", "model.lora.base_dtype=NF4"), "model.lora.base_dtype",
            "fp32, nf4")
    refused(p.cli("plan", *TINY, "model.lora.rank=8", "model.lora.base_dtype=nf4", "model.ffn_dim=200",
                  "model.lora.targets=[q,up]"), "model.lora.base_dtype=nf4", "up 256x200", "16384")


@case("edges", "QLoRA under FSDP2: cpu offload and a weight two ranks cannot cut into whole NF4 blocks are refused; "
               "a resume that drops nf4 suggests a new run")
def _(p: Probe) -> None:
    # dim 128, ffn 256: gate, up and down are 128 x 256, two NF4 scale-factor blocks (one per rank); q is one
    qlora = ("model.lora.rank=8", "model.lora.base_dtype=nf4", "model.dim=128", "model.n_kv_heads=4",
             "model.ffn_dim=256", "sharding=fsdp", "cluster.procs_per_node=2", "train.micro_batch=4")
    before = p.files()
    refused(p.cli("launch", "--dry-run", *TINY, *qlora, "model.lora.targets=[gate,up,down]",
                  "sharding.cpu_offload=true", "runs_dir=r"),
            "sharding.cpu_offload=true", "model.lora.base_dtype=nf4", "sharding.cpu_offload=false")
    refused(p.cli("launch", "--dry-run", *TINY, *qlora, "model.lora.targets=[q,up]", "runs_dir=r"),
            "model.lora.base_dtype=nf4 with sharding.dp_shard=2", "q 128x128", "sharding=ddp")
    nothing_left(p, before, p.tmp / "r")
    succeeded(p.cli("launch", "--dry-run", *TINY, *qlora, "model.lora.targets=[gate,up,down]", "runs_dir=r",
                    "name=f"))
    succeeded(p.cli("launch", "--dry-run", *TINY, "model.lora.rank=8", "model.lora.base_dtype=nf4", "sharding=ddp",
                    "runs_dir=r", "name=q"))
    refused(p.cli("resume", "q", "--runs-dir", "r", "model.lora.base_dtype=fp32"), "model.lora", "--merged")
