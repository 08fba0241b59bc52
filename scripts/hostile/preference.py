"""Preference pairs and objectives (data prepare --format preference, train.objective=dpo|simpo): careless
records, mixed-up data and objectives, and layouts that would split a pair."""

from __future__ import annotations

import json

from hostile.common import Probe, case, nothing_left, refused, succeeded

PAIR = {"prompt": "Is it?", "chosen": "Yes.", "rejected": "No."}
PREPARE = ["--format", "preference", "--chat-template", "chatml", "--workers", "1"]


def pairs_file(p: Probe, *bad: object, name: str = "pairs.jsonl") -> str:
    lines = [json.dumps(PAIR), json.dumps({**PAIR, "chosen": "Sure."}), *(json.dumps(b) for b in bad)]
    (p.tmp / name).write_text("\n".join(lines) + "\n")
    return name


def refused_record(bad: object, *words: str):
    def check(p: Probe) -> None:
        source = pairs_file(p, bad)
        before = p.files()
        refused(p.cli("data", "prepare", source, "--out", "ds", *PREPARE), "line 3", *words)
        nothing_left(p, before, p.tmp / "ds")
    return check


for _name, _bad, _words in [
    ("identical answers", {"prompt": "q", "chosen": "same", "rejected": "same"}, ("identical",)),
    ("an empty chosen answer", {"prompt": "q", "chosen": "", "rejected": "x"}, ("'chosen' is empty",)),
    ("a whitespace rejected answer", {"prompt": "q", "chosen": "x", "rejected": " \n "}, ("'rejected'",)),
    ("no rejected field", {"prompt": "q", "chosen": "x"}, ("no field 'rejected'",)),
    ("answers as numbers", {"prompt": "q", "chosen": 1, "rejected": 2}, ("'chosen'", "number")),
    ("a list of strings as messages", {"prompt": "q", "chosen": ["x"], "rejected": ["y"]}, ("message 0",)),
    ("a JSON array as the record", [1, 2], ("not a json object",)),
]:
    case("preference", f"data prepare --format preference: {_name}")(refused_record(_bad, *_words))


def prepared(p: Probe) -> str:
    succeeded(p.cli("data", "prepare", pairs_file(p), "--out", "ds", *PREPARE, "--val-fraction", "0"))
    return str(p.tmp / "ds")


LAUNCH = ["model=tiny", "data=memmap", "train.seq_len=64", "train.eval_every=0", "--dry-run"]


@case("preference", "SFT on preference pairs, and DPO on plain text")
def _(p: Probe) -> None:
    data = prepared(p)
    refused(p.cli("launch", *LAUNCH, f"data.datasets=[{data}]"), "train.objective=sft", "preference pairs")
    refused(p.cli("launch", "model=tiny", "data=synthetic", "train.objective=dpo", "--dry-run"),
            "train.objective=dpo", "--format preference")


@case("preference", "DPO with pipeline or context parallelism: refused naming what works")
def _(p: Probe) -> None:
    data = prepared(p)
    for extra in (["sharding.pp=2", "train.global_batch=4", "train.micro_batch=1"], ["sharding.cp=2"]):
        key = extra[0].split("=")[0]
        r = p.cli("launch", *LAUNCH, f"data.datasets=[{data}]", "train.objective=dpo", "cluster.procs_per_node=2",
                  *extra)
        refused(r, key, "fsdp", one_line=False)


@case("preference", "DPO hyperparameters out of range: a negative beta, label smoothing above 0.5, NaN")
def _(p: Probe) -> None:
    data = prepared(p)
    for bad, key in (("train.dpo_beta=-1", "train.dpo_beta"), ("train.dpo_label_smoothing=0.7",
                                                               "train.dpo_label_smoothing"),
                     ("train.simpo_gamma=nan", "train.simpo_gamma"), ("train.objective=ppo", "train.objective")):
        refused(p.cli("launch", *LAUNCH, f"data.datasets=[{data}]", "train.objective=dpo", bad), key)


@case("preference", "trainctl eval --data PAIRS on a full-weight DPO run: its reference is in no checkpoint", slow=True)
def _(p: Probe) -> None:
    data = prepared(p)
    pairs = ["model.dim=64", "model.n_layers=1", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=176",
             "train.steps=1", "train.global_batch=2", "train.micro_batch=2", "schedule.warmup_steps=0",
             "cluster.procs_per_node=1", "logging.progress=false", "train.objective=dpo"]
    succeeded(p.cli("launch", *LAUNCH[:-1], f"data.datasets=[{data}]", *pairs, "--name", "dpo", timeout=180))
    refused(p.cli("eval", "dpo", "--data", data, timeout=120), "full-weight DPO", "model.lora.rank > 0")
