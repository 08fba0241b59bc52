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


# A tokenizer folder with ChatML's template: a byte-level BPE learnt from a few words, its ids below the tiny
# model's vocabulary, written as transformers saves one (tokenizer.json beside tokenizer_config.json).
CHAT_TOKENIZER = """
import json, pathlib, tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers
tok = tokenizers.Tokenizer(models.BPE())
tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
tok.train_from_iterator(['user assistant hello there'] * 8, trainers.BpeTrainer(
    vocab_size=64, special_tokens=['<|im_start|>', '<|im_end|>'], show_progress=False))
folder = pathlib.Path('tok'); folder.mkdir(); tok.save(str(folder / 'tokenizer.json'))
template = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n'}}"
            "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\\n'}}{% endif %}")
(folder / 'tokenizer_config.json').write_text(json.dumps({'chat_template': template, 'eos_token': '<|im_end|>'}))
"""
CHAT = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello there"}]


@case("data", "data=hf naming a chat field its rows do not have")
def _(p: Probe) -> None:
    p.python(CHAT_TOKENIZER, timeout=120)
    source = rows(p, [{"conversation": CHAT} for _ in range(4)])
    refused_before_launch(p, f"data.source={source}", f"data.tokenizer={p.tmp / 'tok'}", "data.messages_field=messages",
                          words=("data.messages_field=messages", "conversation"))


@case("data", "data=hf naming a text field and a chat field at once")
def _(p: Probe) -> None:
    source = rows(p, [{"text": "hello", "messages": CHAT} for _ in range(4)])
    refused_before_launch(p, f"data.source={source}", "data.text_field=text", "data.messages_field=messages",
                          words=("data.text_field=text", "data.messages_field=messages", "one kind of row"))


@case("data", "data=hf chat rows with a tokenizer that has no chat template")
def _(p: Probe) -> None:
    source = rows(p, [{"messages": CHAT} for _ in range(4)])
    refused_before_launch(p, f"data.source={source}", "data.messages_field=messages",
                          words=("data.messages_field=messages", "no chat template", "data.prompt_field"))
