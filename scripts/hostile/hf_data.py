"""data=hf: a Hugging Face dataset trained on directly; what is missing or wrong in it is one line before launch."""

from __future__ import annotations

import json

from hostile.common import Probe, case, nothing_left, refused

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
LAUNCH = ["launch", "recipe=tiny_cpu", "data=hf", "data.tokenizer=bytes", "train.eval_every=0", "train.steps=4",
          "train.seq_len=32", "schedule.warmup_steps=1"]


def rows(p: Probe, records: list[dict]) -> str:
    """A .jsonl file of these records in the case's folder; its path."""
    path = p.tmp / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def refused_before_launch(p: Probe, *args: str, words: tuple[str, ...]) -> None:
    before = p.files()
    refused(p.cli(*LAUNCH, *args, env=OFFLINE, timeout=120), *words)
    nothing_left(p, before, p.tmp / "runs")


@case("data", "data=hf whose rows lack the text field")
def _(p: Probe) -> None:
    source = rows(p, [{"body": "some words " * 20} for _ in range(4)])
    refused_before_launch(p, f"data.source={source}", words=("data.text_field=text", "body"))


@case("data", "data=hf whose text field holds numbers")
def _(p: Probe) -> None:
    source = rows(p, [{"text": i} for i in range(4)])
    refused_before_launch(p, f"data.source={source}", words=("data.text_field",))


@case("data", "data=hf naming a split a saved dataset does not have")
def _(p: Probe) -> None:
    code = ("import datasets; rows = datasets.Dataset.from_list([{'text': 'a b c ' * 30}] * 4); "
            "datasets.DatasetDict({'train': rows}).save_to_disk('saved')")
    p.python(code, timeout=120)
    refused_before_launch(p, f"data.source={p.tmp / 'saved'}", "data.split=test", words=("data.split=test", "train"))


@case("data", "data=hf naming a Hub dataset that is not cached, offline")
def _(p: Probe) -> None:
    refused_before_launch(p, "data.source=someorg/not-cached", "data.streaming=true",
                          words=("data.source=someorg/not-cached", "offline"))


@case("data", "data=hf with no source, and evaluation on without a held-out split")
def _(p: Probe) -> None:
    r = p.cli("plan", "recipe=tiny_cpu", "data=hf", "data.tokenizer=bytes", env=OFFLINE)
    refused(r, "data.source", one_line=False)
    refused(r, "data.val_split", one_line=False)
