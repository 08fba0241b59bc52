"""What a model is made of, kept whole (issue 35): weights from outside the model folder, tensors dropped or skipped
without a word, characters that change on the way into tokens, a checkpoint read as another model than it holds."""

from __future__ import annotations

import json
from pathlib import Path

from hostile.common import Probe, case, expect, refused, succeeded, write_json
from hostile.hf import LLAMA, PLAN, TINY_RUN, hf_folder, llama_tensors, plan_with, write_safetensors

# ---------------------------------------------------------------- escapes: an index's files lie in the folder


def index_naming(name_of):
    def check(p: Probe) -> None:
        root = hf_folder(p)
        outside = p.tmp / "elsewhere"
        outside.mkdir()
        write_safetensors(outside / "x.safetensors", llama_tensors())
        name = name_of(outside / "x.safetensors")
        write_json(root / "model.safetensors.index.json", {"weight_map": {"lm_head.weight": name}})
        refused(plan_with(p, root, f"checkpoint.init_from={root}"), "outside", "weight_map")
    return check


for _label, _name_of in (("../elsewhere/x.safetensors", lambda f: "../elsewhere/x.safetensors"),
                         ("an absolute path", str), ("a/../../ path", lambda f: "sub/../../elsewhere/x.safetensors")):
    case("integrity", f"init_from with an index whose weight_map names {_label}")(index_naming(_name_of))


# ---------------------------------------------------------------- headers against the family's tensors


def init_from_weights(change, *words: str):
    def check(p: Probe) -> None:
        tensors = llama_tensors()
        config = change(tensors)
        root = hf_folder(p, config, weights=tensors)
        refused(plan_with(p, root, f"checkpoint.init_from={root}"), "checkpoint.init_from", *words)
    return check


def _extra(tensors):
    tensors["model.vision_tower.weight"] = ("F32", [8, 8])
    return LLAMA


def _missing(tensors):
    del tensors["model.layers.1.mlp.down_proj.weight"]
    return LLAMA


def _misshapen(tensors):
    tensors["model.layers.0.self_attn.k_proj.weight"] = ("F32", [128, 128])
    return LLAMA


def _bias(tensors):
    tensors["model.layers.0.self_attn.q_proj.bias"] = ("F32", [128])
    return LLAMA


case("integrity", "init_from holding an extra tensor (a vision tower)")(
    init_from_weights(_extra, "model.vision_tower.weight"))
case("integrity", "init_from lacking one tensor")(init_from_weights(_missing, "down_proj"))
case("integrity", "init_from with a tensor of another shape")(init_from_weights(_misshapen, "k_proj", "shape"))
case("integrity", "init_from with a q_proj bias the family lacks")(init_from_weights(_bias, "q_proj.bias"))


@case("integrity", "a tied config.json shipping its own, different lm_head.weight")
def _(p: Probe) -> None:
    root = hf_folder(p, {**LLAMA, "tie_word_embeddings": True}, weights=llama_tensors())
    raw = (root / "model.safetensors").read_bytes()
    size = int.from_bytes(raw[:8], "little")
    head = json.loads(raw[8:8 + size])["lm_head.weight"]
    with open(root / "model.safetensors", "r+b") as f:  # one byte of the head differs from the embedding (zeros)
        f.seek(8 + size + head["data_offsets"][0])
        f.write(b"\x01")
    refused(plan_with(p, root, f"checkpoint.init_from={root}"), "tie_word_embeddings", "lm_head.weight")


@case("integrity", "a tied config.json whose lm_head.weight is the embedding (save_pretrained's): accepted")
def _(p: Probe) -> None:
    root = hf_folder(p, {**LLAMA, "tie_word_embeddings": True}, weights=llama_tensors())
    succeeded(p.cli("plan", *PLAN, f"model.path={root}", f"checkpoint.init_from={root}"))


# ---------------------------------------------------------------- records: what text input refuses


def chat_record(fmt: str, record: dict, *words: str):
    def check(p: Probe) -> None:
        good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]} \
            if fmt == "chat" else {"prompt": "hi", "completion": "hello"}
        (p.tmp / "r.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n")
        extra = ["--chat-template", "chatml"] if fmt == "chat" else []
        r = p.cli("data", "prepare", "r.jsonl", "--out", "ds", "--format", fmt, *extra)
        refused(r, "r.jsonl", *words)
        expect(not (p.tmp / "ds").exists(), "wrong", "left ds behind")
    return check


_USER = {"role": "user", "content": "hi"}
for _label, _fmt, _record, _words in (
        ("a lone surrogate in a chat answer", "chat",
         {"messages": [_USER, {"role": "assistant", "content": "x\ud800"}]}, ("unpaired",)),
        ("a NUL in a chat question", "chat",
         {"messages": [{"role": "user", "content": "a\u0000b"}, {"role": "assistant", "content": "c"}]}, ("NUL",)),
        ("a NUL in a chat role", "chat",
         {"messages": [{"role": "user\u0000", "content": "a"}, {"role": "assistant", "content": "c"}]}, ("role",)),
        ("a lone surrogate in an instruction prompt", "instruction", {"prompt": "\udfff", "completion": "c"},
         ("prompt", "unpaired")),
        ("a NUL in an instruction completion", "instruction", {"prompt": "p", "completion": "c\u0000"},
         ("completion", "NUL"))):
    case("integrity", f"{_label} (data prepare)")(chat_record(_fmt, _record, *_words))


@case("integrity", "a NUL escape in a .jsonl text field (data prepare)")
def _(p: Probe) -> None:
    (p.tmp / "t.jsonl").write_text('{"text": "plain words"}\n{"text": "a\\u0000b"}\n')
    refused(p.cli("data", "prepare", "t.jsonl", "--out", "ds"), "t.jsonl", "NUL")


# ---------------------------------------------------------------- checkpoints: what model they hold


def trained(p: Probe, name: str, *extra: str) -> Path:
    succeeded(p.cli("launch", *TINY_RUN, *extra, "--name", name, timeout=180))
    return p.tmp / "runs" / name


def edit_config(run_dir: Path, old: str, new: str) -> None:
    text = (run_dir / "config.yaml").read_text()
    expect(old in text, "wrong", f"harness: {old!r} not in config.yaml")
    (run_dir / "config.yaml").write_text(text.replace(old, new))


@case("integrity", "export --verify, generate and resume of a run whose config.yaml was edited since",
      slow=True)
def _(p: Probe) -> None:
    run = trained(p, "run")
    edit_config(run, "rope_theta: 10000.0", "rope_theta: 500000.0")
    refused(p.cli("export", "run", "--out", "out", "--verify", timeout=120), "model.rope_theta")
    expect(not (p.tmp / "out").exists(), "wrong", "exported")
    refused(p.cli("generate", "run", "--prompt", "hi", "--max-new-tokens", "2", timeout=120), "model.rope_theta")
    refused(p.cli("resume", "run", "train.steps=4", timeout=120), "model.rope_theta")


@case("integrity", "generate and export --checkpoint of another run's checkpoint (another norm_eps)", slow=True)
def _(p: Probe) -> None:
    trained(p, "a")
    other = trained(p, "b", "model.norm_eps=1e-6")
    ckpt = sorted((other / "checkpoints").glob("step-*"))[-1]
    refused(p.cli("generate", "a", "--checkpoint", ckpt, "--prompt", "hi", "--max-new-tokens", "2", timeout=120),
            "model.norm_eps")
    refused(p.cli("export", "a", "--checkpoint", ckpt, "--out", "out", timeout=120), "model.norm_eps")


@case("integrity", "a full fine-tune from a LoRA run's checkpoint (load_only=model) is refused, naming the way",
      slow=True)
def _(p: Probe) -> None:
    lora = trained(p, "lora", "model.lora.rank=4")
    before = sorted(path.name for path in (p.tmp / "runs").iterdir())
    r = p.cli("launch", *TINY_RUN, f"checkpoint.resume={lora}", "checkpoint.load_only=model", "--name", "full",
              timeout=120)
    refused(r, "LoRA", "--merged", "checkpoint.init_from")
    after = sorted(path.name for path in (p.tmp / "runs").iterdir())
    expect(before == after, "wrong", f"left a run directory behind: {sorted(set(after) - set(before))}")
