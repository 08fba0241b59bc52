"""`data prepare --format chat|instruction`: templates rendered as transformers renders them, loss masks on the
answers only (from one encoding's offsets), and every refusal in one line with nothing left behind."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import cli_in_process
from trainctl.data import format as dataset
from trainctl.data.chat import RecordOptions
from trainctl.data.chat_template import BUILTIN, ChatTemplate, assistant_spans, load_template, render
from trainctl.data.prepare import prepare
from trainctl.data.shards import intact_units

LLAMA3 = BUILTIN["llama3"]
QWEN = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "<|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""  # noqa: E501 (Qwen 2.5's template, its tool-call branch shortened)
MISTRAL = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
           "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
           "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
           "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")
ZEPHYR = """{% for message in messages %}
{% if message['role'] == 'user' %}
{{ '<|user|>\n' + message['content'] + eos_token }}
{% elif message['role'] == 'system' %}
{{ '<|system|>\n' + message['content'] | tojson + eos_token }}
{% elif message['role'] == 'assistant' %}
{{ '<|assistant|>\n'  + message['content'] + eos_token }}
{% endif %}
{% if loop.last and add_generation_prompt %}
{{ '<|assistant|>' }}
{% endif %}
{% endfor %}"""  # Zephyr's: multi-line blocks (trim_blocks, lstrip_blocks), plus tojson (no HTML escaping)
TEMPLATES = {
    "llama3": (LLAMA3, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "qwen": (QWEN, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "mistral": (MISTRAL, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}),
    "zephyr": (ZEPHYR, {"eos_token": "</s>"}),
}
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>", "</s>", "<unk>"]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."}],
    [{"role": "system", "content": "Be brief <b>&</b> ü. "}, {"role": "user", "content": "  Hi  there "},
     {"role": "assistant", "content": "Hello! ünïcode ✓ {\"a\": 1}"}, {"role": "user", "content": "and again"},
     {"role": "assistant", "content": " Twice, with spaces. "}],
]


def chats_for(name: str) -> list[list[dict]]:
    """Mistral's template takes no system message (it raises on one)."""
    return [[m for m in c if m["role"] != "system" or name != "mistral"] for c in CHATS]


def tokenizer_folder(root: Path, name: str) -> Path:
    """A byte-level BPE tokenizer.json with the templates' special tokens, and a tokenizer_config.json."""
    tokenizers = pytest.importorskip("tokenizers")
    folder = root / name
    folder.mkdir()
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([json.dumps(c) for c in CHATS] * 20, trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    template, tokens = TEMPLATES[name]
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, **tokens}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def read_split(out: Path, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
    meta = dataset.read_meta(out)
    tokens = np.concatenate([np.fromfile(p, meta.token_dtype) for p in meta.shard_paths(split)])
    flags = np.concatenate([np.fromfile(p, np.uint8) for p in meta.mask_paths(split)])
    return tokens, flags


# ---------------------------------------------------------------- masks (tests/dist/test_chat_templates.py: rendering)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_only_assistant_tokens_count(tmp_path, name):
    folder = tokenizer_folder(tmp_path, name)
    source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in chats_for(name)])
    prepare([str(source)], tmp_path / "out", tokenizer=str(folder), val_fraction=0, workers=1,
            records=RecordOptions("chat"))
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokens, flags = read_split(tmp_path / "out")
    counted = tok.decode(tokens[(flags & dataset.LOSS) > 0].tolist(), skip_special_tokens=False)
    answers = [m["content"].strip() if name == "llama3" else m["content"]
               for c in CHATS for m in c if m["role"] == "assistant"]
    end = {"llama3": "<|eot_id|>", "qwen": "<|im_end|>\n", "mistral": "</s>", "zephyr": "</s>\n"}[name]
    assert counted.replace(" ", "") == "".join(a + end for a in answers).replace(" ", "")
    starts = np.flatnonzero(flags & dataset.DOC_START)
    assert len(starts) == len(CHATS) and starts[0] == 0
    prompt_text = tok.decode(tokens[(flags & dataset.LOSS) == 0].tolist(), skip_special_tokens=False)
    assert "capital of France" in prompt_text and "Paris" not in prompt_text


def test_bytes_and_builtin_template_mask_the_prompt_exactly(tmp_path):
    source = write_jsonl(tmp_path / "c.jsonl", [{"conv": CHATS[1]}])
    prepare([str(source)], tmp_path / "out", val_fraction=0, workers=1,
            records=RecordOptions("chat", messages_field="conv"), chat_template="chatml")
    tokens, flags = read_split(tmp_path / "out")
    text = bytes(tokens.astype(np.uint8))
    assert text.endswith(b"\0") and flags[-1] == dataset.DOC_START * 0  # the appended EOS does not count
    counted = bytes(tokens[(flags & 1) > 0].astype(np.uint8)).decode()
    assert counted == "Hello! ünïcode ✓ {\"a\": 1}<|im_end|>\n Twice, with spaces. <|im_end|>\n"


def test_instruction_counts_completion_and_eos(tmp_path):
    source = write_jsonl(tmp_path / "i.jsonl", [{"q": "Add 2 and 2: ", "a": "4"}, {"q": "Say hi: ", "a": "hi"}])
    prepare([str(source)], tmp_path / "out", val_fraction=0, workers=1,
            records=RecordOptions("instruction", prompt_field="q", completion_field="a"))
    tokens, flags = read_split(tmp_path / "out")
    assert bytes(tokens.astype(np.uint8)) == b"Add 2 and 2: 4\0Say hi: hi\0"
    assert (flags & 1).tolist() == [0] * 13 + [1, 1] + [0] * 8 + [1, 1, 1]
    assert np.flatnonzero(flags & 2).tolist() == [0, 15]


# ---------------------------------------------------------------- refusals


def answer(monkeypatch, capsys, *argv: str) -> tuple[int, str]:
    code, _, err = cli_in_process(monkeypatch, capsys, "data", "prepare", *argv)
    return code, err


GOOD = {"messages": CHATS[0]}
REFUSED = {
    "no-template": ([GOOD], [], "has no chat template"),
    "role": ([{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}],
             ["--tokenizer", "mistral"], "Conversation roles must alternate"),
    "empty": ([{"messages": []}], ["--chat-template", "chatml"], "'messages' is an empty list"),
    "content": ([{"messages": [{"role": "user", "content": ["a"]}]}], ["--chat-template", "chatml"],
                "message 0: content is a list, not a string"),
    "no-answer": ([{"messages": [{"role": "user", "content": "a"}]}], ["--chat-template", "chatml"],
                  "no assistant message"),
    "overlong": ([GOOD], ["--chat-template", "chatml", "--max-doc-tokens", "20"], "more than --max-doc-tokens 20"),
    "truncated-answer": ([GOOD], ["--chat-template", "chatml", "--max-doc-tokens", "20", "--overlong", "truncate"],
                         "no token of the answer within --max-doc-tokens"),
    "field": ([{"text": "x"}], ["--chat-template", "chatml"], "no field 'messages'"),
    "prefix": ([GOOD], ["--chat-template", "PREFIX"], "the prefix property does not hold"),
    # what text input refuses: a tokenizer would write '?' for a lone surrogate, and the byte one drops NUL
    "surrogate": ([{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b\ud800"}]}],
                  ["--chat-template", "chatml"], "message 1: content holds an unpaired"),
    "nul": ([{"messages": [{"role": "user", "content": "a\u0000b"}, {"role": "assistant", "content": "c"}]}],
            ["--chat-template", "chatml"], "message 0: content holds a NUL character"),
    "nul-role": ([{"messages": [{"role": "user\u0000", "content": "a"}, {"role": "assistant", "content": "c"}]}],
                 ["--chat-template", "chatml"], "message 0: role holds a NUL"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refusals_are_one_line(tmp_path, monkeypatch, capsys, case):
    records, options, words = REFUSED[case]
    source = write_jsonl(tmp_path / "chat.jsonl", [GOOD] * 3 + records)
    if "mistral" in options:
        options = ["--tokenizer", str(tokenizer_folder(tmp_path, "mistral"))]
    if "PREFIX" in options:  # a template that renders the last turn differently from earlier ones
        (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% if loop.last %}!{% endif %}"
                                          "{% endfor %}")
        options = ["--chat-template", str(tmp_path / "t.jinja")]
    code, err = answer(monkeypatch, capsys, str(source), "--out", str(tmp_path / "out"), "--format", "chat",
                       "--workers", "1", *options)
    assert code == 2 and err.startswith("error: ") and words in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_truncate_keeps_the_first_tokens(tmp_path):
    source = write_jsonl(tmp_path / "c.jsonl", [GOOD])
    prepare([str(source)], tmp_path / "out", val_fraction=0, workers=1, chat_template="chatml",
            records=RecordOptions("chat", max_doc_tokens=90, overlong="truncate"))
    tokens, flags = read_split(tmp_path / "out")
    assert len(tokens) == 90 and bytes(tokens.astype(np.uint8)).endswith(b"assistant\nParis.<|im")
    assert (flags & 1).tolist() == [0] * 80 + [1] * 10


# ---------------------------------------------------------------- the format


def prepared(tmp_path: Path, **options) -> Path:
    source = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHATS[i % 2]} for i in range(40)])
    prepare([str(source)], tmp_path / "out", workers=1, val_fraction=0.2, chat_template="chatml",
            records=RecordOptions("chat"), **options)
    return tmp_path / "out"


def test_mask_shard_of_another_length_is_refused(tmp_path):
    out = prepared(tmp_path, shard_tokens=1000)
    meta = dataset.read_meta(out)
    assert meta.content == "chat" and meta.masked and len(meta.splits["train"].shards) > 1
    assert dataset.dataset_problems(out, "train", 256, 64) == []
    mask = meta.mask_paths("train")[1]
    size = mask.stat().st_size
    mask.write_bytes(mask.read_bytes()[:-1])
    problems = dataset.dataset_problems(out, "train", 256, 64)
    assert len(problems) == 1 and f"mask {mask.name} is {size - 1} bytes" in problems[0], problems


def test_version_1_dataset_still_loads(tmp_path):
    (tmp_path / "a.txt").write_text("some text " * 50)
    out = tmp_path / "out"
    prepare([str(tmp_path / "a.txt")], out, workers=1, val_fraction=0)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["version"] == 2 and "mask" not in json.dumps(meta["splits"])
    meta["version"] = 1
    del meta["content"]
    (out / "meta.json").write_text(json.dumps(meta))
    loaded = dataset.read_meta(out)
    assert loaded.content == "text" and not loaded.masked and loaded.mask_paths("train") is None


def test_resume_rechecks_the_masks(tmp_path):
    """A unit's recorded sha256 covers its mask bytes: a changed mask byte makes the unit be done again."""
    out = prepared(tmp_path)
    import hashlib

    def segment(split: str) -> list:
        tokens, mask = (out / f"{split}-00000.bin").read_bytes(), (out / f"{split}-00000.mask").read_bytes()
        return [len(mask), 0, hashlib.sha256(tokens + mask).hexdigest()]

    unit = {"train": segment("train"), "val": segment("val"), "pieces": 40}
    assert intact_units(out, [unit], "uint16", 1 << 28, masked=True) == 1
    mask = bytearray((out / "train-00000.mask").read_bytes())
    mask[5] ^= 1
    (out / "train-00000.mask").write_bytes(bytes(mask))
    assert intact_units(out, [unit], "uint16", 1 << 28, masked=True) == 0


def test_template_from_a_named_list_and_a_file(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ bos_token }}D"}],
         "bos_token": {"content": "<s>", "lstrip": False}}))
    template = load_template(None, folder)
    assert render(template, [{"role": "user", "content": "x"}]) == "<s>D"
    (folder / "chat_template.jinja").write_text("J")
    assert load_template(None, folder).text == "J"  # what transformers 5 saves wins, as there
    whole, spans = assistant_spans(ChatTemplate(BUILTIN["chatml"], "t"), CHATS[0])
    assert [whole[a:b] for a, b in spans] == ["Paris.<|im_end|>\n"]


# ---------------------------------------------------------------- resume


def damage_masks(out: Path, how: str) -> None:
    masks = sorted(out.glob("train-*.mask"))
    assert len(masks) >= 2, "the interrupted run should have written several mask files"
    if how == "truncate-last":
        masks[-1].write_bytes(masks[-1].read_bytes()[:-3])
    elif how == "flip-first":
        data = bytearray(masks[0].read_bytes())
        data[len(data) // 2] ^= 0x01
        masks[0].write_bytes(bytes(data))
    elif how == "delete-first":
        masks[0].unlink()
    elif how == "stray":
        (out / "train-00042.mask").write_bytes(b"\x01" * 5)


@pytest.mark.parametrize("how", ["truncate-last", "flip-first", "delete-first", "stray"])
def test_an_interrupted_chat_prepare_resumes_to_the_same_bytes(tmp_path, how):
    source = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHATS[i % 2]} for i in range(16)])
    options = dict(val_fraction=0.3, shard_tokens=300, workers=1, unit_bytes=400, chat_template="chatml",
                   records=RecordOptions("chat"))
    prepare([str(source)], tmp_path / "clean", **options)
    calls = []

    def stop(done, total):
        calls.append(done)
        if len(calls) == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare([str(source)], tmp_path / "out", progress=stop, **options)
    damage_masks(tmp_path / "out", how)
    prepare([str(source)], tmp_path / "out", **options)

    def files(folder: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != "meta.json"}

    assert files(tmp_path / "out") == files(tmp_path / "clean")
    assert any(name.endswith(".mask") for name in files(tmp_path / "clean"))


def test_meta_counts_loss_tokens_and_the_cli_says_so(tmp_path, monkeypatch, capsys):
    source = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHATS[0]}] * 3)
    code, out, _ = cli_in_process(monkeypatch, capsys, "data", "prepare", str(source), "--out", str(tmp_path / "out"),
                                  "--format", "chat", "--chat-template", "chatml", "--val-fraction", "0",
                                  "--workers", "1")
    assert code == 0
    meta = dataset.read_meta(tmp_path / "out")
    _, flags = read_split(tmp_path / "out")
    per_record = len("Paris.<|im_end|>\n")
    assert meta.splits["train"].loss_tokens == int((flags & 1).sum()) == 3 * per_record
    assert "of them in the loss" in out
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["chat_template"]["source"] == "built-in chatml"


def test_instruction_records_from_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"prompt": ["Q: one? A: ", "Q: two? A: "], "completion": ["1", "2"], "id": [1, 2]})
    pq.write_table(table, tmp_path / "i.parquet", row_group_size=1)
    prepare([str(tmp_path / "i.parquet")], tmp_path / "out", val_fraction=0, workers=1,
            records=RecordOptions("instruction"))
    tokens, flags = read_split(tmp_path / "out")
    assert bytes(tokens.astype(np.uint8)) == b"Q: one? A: 1\0Q: two? A: 2\0"
    assert bytes(tokens[(flags & 1) > 0].astype(np.uint8)) == b"1\x002\x00"


def test_text_files_are_refused_for_records(tmp_path):
    (tmp_path / "a.txt").write_text("text")
    with pytest.raises(dataset.DatasetError, match=r"--format instruction: reads \.jsonl and \.parquet records, not "
                                                   r"\.txt files"):
        prepare([str(tmp_path / "a.txt")], tmp_path / "out", records=RecordOptions("instruction"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("completion", ["b\ud800", "b\u0000c"])
def test_instruction_fields_holding_what_text_input_refuses_are_refused(tmp_path, monkeypatch, capsys, completion):
    source = write_jsonl(tmp_path / "i.jsonl", [{"prompt": "a", "completion": completion}])
    code, err = answer(monkeypatch, capsys, str(source), "--out", str(tmp_path / "out"), "--format", "instruction",
                       "--workers", "1")
    assert code == 2 and "i.jsonl: byte 0: field 'completion' holds" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
