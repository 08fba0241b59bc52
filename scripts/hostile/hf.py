"""Hugging Face folders in (model.path, checkpoint.init_from) and exports out: wrong types, strange files, bad flags."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

from hostile.common import Probe, Verdict, case, expect, nothing_left, refused, succeeded, write_json

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 352, "vocab_size": 512,
         "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
         "hidden_act": "silu"}
PLAN = ["model=hf", "data=synthetic", "train.seq_len=64", "cluster.procs_per_node=1", "sharding=none",
        "train.global_batch=4", "train.micro_batch=4", "train.grad_accum=-1"]
# A run small enough to train two steps on one CPU worker in seconds (export cases need a checkpoint).
TINY_RUN = ["recipe=tiny_cpu", "train.steps=2", "train.eval_every=0", "cluster.procs_per_node=1", "sharding=none",
            "schedule.warmup_steps=1", "model.dim=64", "model.n_layers=1", "model.n_heads=4", "model.n_kv_heads=2",
            "model.ffn_dim=176", "train.seq_len=32", "train.global_batch=2", "train.micro_batch=2",
            "train.grad_accum=-1", "logging.progress=false"]


def hf_folder(p: Probe, config: dict | str | None = None, name: str = "hf", weights: dict | None = None) -> Path:
    """A Hugging Face folder with this config.json (a dict, or raw text) and, if given, a safetensors header."""
    root = p.tmp / name
    root.mkdir()
    text = config if isinstance(config, str) else json.dumps(LLAMA if config is None else config)
    (root / "config.json").write_text(text)
    if weights is not None:
        write_safetensors(root / "model.safetensors", weights)
    return root


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A safetensors file of zeros: name -> (dtype, shape); written by hand (8-byte size, JSON header, data)."""
    sizes = {"F32": 4, "BF16": 2, "F16": 2, "I8": 1, "I32": 4, "I64": 8, "U8": 1}
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        nbytes = sizes[dtype] * math.prod(shape)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def llama_tensors(dtype: str = "F32") -> dict[str, tuple[str, list[int]]]:
    d, f, v, kv = 128, 352, 512, 64
    tensors = {"model.embed_tokens.weight": (dtype, [v, d]), "model.norm.weight": ("F32", [d]),
               "lm_head.weight": (dtype, [v, d])}
    shapes = {"self_attn.q_proj": [d, d], "self_attn.k_proj": [kv, d], "self_attn.v_proj": [kv, d],
              "self_attn.o_proj": [d, d], "mlp.gate_proj": [f, d], "mlp.up_proj": [f, d], "mlp.down_proj": [d, f]}
    for i in range(2):
        pre = f"model.layers.{i}."
        tensors.update({f"{pre}{name}.weight": (dtype, shape) for name, shape in shapes.items()})
        norms = ("input_layernorm", "post_attention_layernorm")
        tensors.update({f"{pre}{norm}.weight": ("F32", [d]) for norm in norms})
    return tensors


def plan_with(p: Probe, root: Path, *extra: str):
    return p.cli("plan", *PLAN, f"model.path={root}", *extra)


def bad_field(key: str, value, *words: str):
    def check(p: Probe) -> None:
        root = hf_folder(p, {**LLAMA, key: value})
        # head_dim "32" is hidden_size / heads written as a string: it must not be called the wrong size.
        refused(plan_with(p, root), key, *words, absent=("is not hidden_size",))
    return check


for _key, _value in (("hidden_size", "128"), ("num_key_value_heads", 0), ("head_dim", "32"), ("rope_theta", [1]),
                     ("tie_word_embeddings", "yes"), ("rms_norm_eps", None), ("num_attention_heads", 0),
                     ("hidden_size", -128), ("vocab_size", 1.5), ("rope_scaling", [1, 2]),
                     ("rope_scaling", "llama3"), ("max_position_embeddings", True)):
    case("hf", f"config.json with {_key}: {json.dumps(_value)}")(bad_field(_key, _value))


@case("hf", "config.json holding NaN for rms_norm_eps")
def _(p: Probe) -> None:
    root = hf_folder(p, json.dumps(LLAMA).replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": NaN'))
    refused(plan_with(p, root), "rms_norm_eps")


@case("hf", "config.json that is a JSON list")
def _(p: Probe) -> None:
    refused(plan_with(p, hf_folder(p, "[1, 2]")), "config.json")


@case("hf", "config.json that is a FIFO")
def _(p: Probe) -> None:
    root = p.tmp / "hf"
    root.mkdir()
    os.mkfifo(root / "config.json")
    refused(p.cli("plan", *PLAN, f"model.path={root}", timeout=30), "config.json")


@case("hf", "config.json that is a directory")
def _(p: Probe) -> None:
    root = p.tmp / "hf"
    (root / "config.json").mkdir(parents=True)
    refused(plan_with(p, root), "config.json")


@case("hf", "a Qwen2 config.json given to model=hf (a family trainctl loads: read, not refused)")
def _(p: Probe) -> None:
    root = hf_folder(p, {**LLAMA, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]})
    succeeded(plan_with(p, root), "qwen2")


@case("hf", "mixture-of-experts config.json files given to model=hf: Mixtral plans, DeepSeek-V3 is refused")
def _(p: Probe) -> None:
    root = hf_folder(p, {**LLAMA, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
                         "num_local_experts": 8, "num_experts_per_tok": 2})
    succeeded(plan_with(p, root), "mixtral")
    other = hf_folder(p, {**LLAMA, "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
                          "n_routed_experts": 8, "num_experts_per_tok": 2}, name="deepseek")
    refused(plan_with(p, other), "model_type", "mixtral", "qwen3_moe")


@case("hf", "init_from a folder whose weights are int8")
def _(p: Probe) -> None:
    root = hf_folder(p, weights=llama_tensors("I8"))
    refused(plan_with(p, root, f"checkpoint.init_from={root}"), "model.safetensors")


@case("hf", "init_from a safetensors file whose header claims 1 TB")
def _(p: Probe) -> None:
    root = hf_folder(p)
    (root / "model.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"{}")
    refused(plan_with(p, root, f"checkpoint.init_from={root}"), "model.safetensors")


@case("hf", "init_from with an index naming a missing shard")
def _(p: Probe) -> None:
    root = hf_folder(p)
    write_json(root / "model.safetensors.index.json", {"weight_map": {"lm_head.weight": "model-00002.safetensors"}})
    refused(plan_with(p, root, f"checkpoint.init_from={root}"), "model-00002.safetensors")


@case("hf", "byte-token data into a model folder that ships a BPE tokenizer")
def _(p: Probe) -> None:
    root = hf_folder(p, weights=llama_tensors())
    code = ("import sys; from tokenizers import Tokenizer, models, pre_tokenizers\n"
            "t = Tokenizer(models.BPE()); t.pre_tokenizer = pre_tokenizers.ByteLevel()\n"
            "t.add_special_tokens(['<|endoftext|>']); t.save(sys.argv[1])")
    expect(p.python(code, str(root / "tokenizer.json")).code == 0, "wrong", "could not write a tokenizer")
    (p.tmp / "t.txt").write_text("plain text for byte tokens. " * 400)
    succeeded(p.cli("data", "prepare", "t.txt", "--out", "ds", "--val-fraction", "0.2"))
    r = p.cli("plan", *[o for o in PLAN if not o.startswith("data=")], "data=memmap", f"data.datasets=[{p.tmp / 'ds'}]",
              f"model.path={root}", f"checkpoint.init_from={root}", "train.eval_every=0")  # one 11 KB file: no val
    refused(r, "tokenizer")


# ---------------------------------------------------------------- export


def trained(p: Probe, *extra: str) -> Path:
    r = p.cli("launch", *TINY_RUN, *extra, "--name", "run", timeout=180)
    succeeded(r)
    return p.tmp / "runs" / "run"


def export_refused(out: str, *words: str):
    def check(p: Probe) -> None:
        trained(p)
        before = p.files()
        refused(p.cli("export", "run", "--out", out, timeout=120), *words)
        nothing_left(p, before)
    return check


for _out in ("", ".", "/"):
    case("hf", f"export --out {_out!r}", slow=True)(export_refused(_out, "--out"))


@case("hf", "export --out an existing folder of the user's", slow=True)
def _(p: Probe) -> None:
    trained(p)
    (p.tmp / "mine").mkdir()
    (p.tmp / "mine" / "notes.txt").write_text("keep me")
    before = p.files()
    refused(p.cli("export", "run", "--out", "mine", timeout=120), "mine")
    nothing_left(p, before)


@case("hf", "export --dtype bf16 from the CLI, and --dtype int8 refused", slow=True)
def _(p: Probe) -> None:
    trained(p)
    succeeded(p.cli("export", "run", "--out", "out16", "--dtype", "bf16", timeout=180))
    config = json.loads((p.tmp / "out16" / "config.json").read_text())
    expect(config.get("torch_dtype", config.get("dtype")) == "bfloat16", "wrong", f"dtype {config.get('torch_dtype')}")
    refused(p.cli("export", "run", "--out", "out8", "--dtype", "int8"), "dtype")


@case("hf", "export of a run that has no checkpoint")
def _(p: Probe) -> None:
    succeeded(p.cli("launch", *TINY_RUN, "--dry-run", "--name", "run"))
    refused(p.cli("export", "run", timeout=120), "checkpoint")


@case("hf", "export --max-shard-size garbage", slow=True)
def _(p: Probe) -> None:
    trained(p)
    refused(p.cli("export", "run", "--out", "o", "--max-shard-size", "lots", timeout=120), "max-shard-size")


@case("hf", "export bundles the tokenizer the run trained with, not the one at the data path now", slow=True)
def _(p: Probe) -> None:
    (p.tmp / "a.txt").write_text("alpha beta gamma delta " * 3000)
    succeeded(p.cli("data", "prepare", "a.txt", "--out", "ds", "--train-tokenizer", "--vocab-size", "300",
                    "--val-fraction", "0.2"))
    original = (p.tmp / "ds" / "tokenizer.json").read_bytes()
    trained(p, "data=memmap", f"data.datasets=[{p.tmp / 'ds'}]", "model.vocab_size=300")
    os.rename(p.tmp / "ds", p.tmp / "ds-old")  # the user prepares the data path anew, with another tokenizer
    (p.tmp / "b.txt").write_text("zeta eta theta iota " * 3000)
    succeeded(p.cli("data", "prepare", "b.txt", "--out", "ds", "--train-tokenizer", "--vocab-size", "280",
                    "--val-fraction", "0.2"))
    r = p.cli("export", "run", "--out", "out", timeout=180)
    succeeded(r)
    exported = (p.tmp / "out" / "tokenizer.json").read_bytes() if (p.tmp / "out" / "tokenizer.json").exists() else b""
    expect(exported == original, "wrong", "the export bundles another tokenizer than the run trained with")


# ---------------------------------------------------------------- export --verify (models/verify.py)


@case("hf", "export --verify into an existing folder of the user's", slow=True)
def _(p: Probe) -> None:
    trained(p)
    (p.tmp / "mine").mkdir()
    (p.tmp / "mine" / "model.safetensors").write_text("an earlier export, keep me")
    before = p.files()
    refused(p.cli("export", "run", "--out", "mine", "--verify", timeout=120), "mine", "already exists")
    nothing_left(p, before)


@case("hf", "export --verify of a run that has no checkpoint")
def _(p: Probe) -> None:
    succeeded(p.cli("launch", *TINY_RUN, "--dry-run", "--name", "run"))
    before = p.files()
    refused(p.cli("export", "run", "--verify", timeout=120), "checkpoint")
    nothing_left(p, before)


@case("hf", "export --verify of a run whose tokenizer record is gone", slow=True)
def _(p: Probe) -> None:
    (p.tmp / "a.txt").write_text("alpha beta gamma delta " * 3000)
    succeeded(p.cli("data", "prepare", "a.txt", "--out", "ds", "--train-tokenizer", "--vocab-size", "300",
                    "--val-fraction", "0.2"))
    run = trained(p, "data=memmap", f"data.datasets=[{p.tmp / 'ds'}]", "model.vocab_size=300")
    (run / "tokenizer" / "record.json").unlink()
    before = p.files()
    refused(p.cli("export", "run", "--verify", timeout=180), "record.json", "missing")
    nothing_left(p, before)


@case("hf", "export --verify of a good run says what it compared", slow=True)
def _(p: Probe) -> None:
    trained(p)
    succeeded(p.cli("export", "run", "--out", "out", "--verify", timeout=180), "verified: transformers loads it")


@case("hf", "model.path a Hub name missing from an empty cache while offline")
def _(p: Probe) -> None:
    env = {"HF_HUB_CACHE": str(p.tmp / "hub"), "HF_HUB_OFFLINE": "1"}
    r = p.cli("plan", *PLAN, "model.path=meta-llama/Llama-3.2-1B", env=env, timeout=60)
    refused(r, "model.path=meta-llama/Llama-3.2-1B", "HF_HUB_OFFLINE", "hf download meta-llama/Llama-3.2-1B")


@case("hf", "model.path a Hub name whose cache entry names a snapshot that is not there")
def _(p: Probe) -> None:
    refs = p.tmp / "hub" / "models--org--gone" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text("0" * 40)
    env = {"HF_HUB_CACHE": str(p.tmp / "hub"), "HF_HUB_OFFLINE": "1"}
    refused(p.cli("plan", *PLAN, "model.path=org/gone", env=env, timeout=60), "model.path=org/gone")


@case("data", "the same data prepare --hf started twice at once, each to its own --out")
def _(p: Probe) -> None:
    lines = (json.dumps({"text": f"row {i}: " + "some words " * (i % 9 + 1)}) + "\n" for i in range(3000))
    (p.tmp / "rows.jsonl").write_text("".join(lines))
    r = p.python("import datasets, sys; datasets.Dataset.from_json(sys.argv[1]).save_to_disk(sys.argv[2])",
                 str(p.tmp / "rows.jsonl"), str(p.tmp / "rows"))
    expect(r.code == 0, "wrong", f"could not save the test dataset: {r.brief()}")
    env = {"TMPDIR": str(p.tmp / "tmp")}
    (p.tmp / "tmp").mkdir()
    argv = [sys.executable, "-m", "trainctl.cli", "data", "prepare", "--hf", "rows", "--workers", "1", "--out"]
    procs = [p.popen([*argv, out], env=env) for out in ("a", "b")]
    try:
        ends = [(proc.communicate(timeout=300)[1], proc.returncode) for proc in procs]
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        raise Verdict("hang", "a data prepare --hf still running after 300 s") from None
    for err, code in ends:
        expect(code == 0, "wrong", f"exit {code}: {err.strip().splitlines()[-1:] if err.strip() else ''}")
    tokens = [{k: v for k, v in p.files(p.tmp / out).items() if k.endswith((".bin", ".mask"))} for out in "ab"]
    expect(tokens[0] == tokens[1] and tokens[0], "wrong", "the two prepares wrote different token files")
    expect(not list((p.tmp / "tmp").iterdir()), "wrong", f"left in TMPDIR: {sorted(os.listdir(p.tmp / 'tmp'))}")
