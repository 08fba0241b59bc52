"""`trainctl data prepare` and the prepared datasets a plan reads: odd text, strange files, damaged shards."""

from __future__ import annotations

import gzip
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

from hostile.common import Probe, Verdict, case, expect, nothing_left, refused, succeeded

TINY_PLAN = ["recipe=tiny_cpu", "data=memmap", "train.seq_len=32", "train.eval_every=5"]


def zen(p: Probe, folder: str = "text", files: int = 6) -> Path:
    root = p.tmp / folder
    root.mkdir(exist_ok=True)
    for i in range(files):
        (root / f"zen{i}.txt").write_text(f"file {i}\n" + "Beautiful is better than ugly. " * 40)
    return root


def word_tokenizer(p: Probe, vocab: dict[str, int], name: str = "tok.json") -> Path:
    """A Hugging Face tokenizer.json (word level, whitespace) with exactly these ids."""
    path = p.tmp / name
    code = ("import sys, json; from tokenizers import Tokenizer, models, pre_tokenizers\n"
            "t = Tokenizer(models.WordLevel(json.loads(sys.argv[1]), unk_token='[UNK]'))\n"
            "t.pre_tokenizer = pre_tokenizers.Whitespace(); t.save(sys.argv[2])")
    r = p.python(code, json.dumps(vocab), str(path))
    expect(r.code == 0, "wrong", f"could not write the test tokenizer: {r.brief()}")
    return path


def shard_ids(out: Path, split: str = "train") -> np.ndarray:
    meta = json.loads((out / "meta.json").read_text())
    parts = [np.fromfile(out / s["file"], dtype=meta["token_dtype"]) for s in meta["splits"][split]["shards"]]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)


@case("data", "a tokenizer.json of 5 tokens whose largest id is 70000")
def _(p: Probe) -> None:
    tok = word_tokenizer(p, {"[UNK]": 0, "hello": 1, "world": 2, "<|endoftext|>": 3, "big": 70000})
    (p.tmp / "a.txt").write_text("hello big world " * 50)
    r = p.cli("data", "prepare", "a.txt", "--out", "ds", "--tokenizer", tok, "--val-fraction", "0")
    succeeded(r)
    meta = json.loads((p.tmp / "ds" / "meta.json").read_text())
    ids = shard_ids(p.tmp / "ds")
    expect(int(ids.max()) == 70000, "wrong", f"the id 70000 was written as {int(ids.max())} ({meta['token_dtype']})")
    expect(meta["tokenizer"]["vocab_size"] > 70000, "wrong", f"meta.json says vocab {meta['tokenizer']['vocab_size']}")


@case("data", "a tokenizer.json with an id past 2**32")
def _(p: Probe) -> None:
    tok = p.tmp / "tok.json"
    word_tokenizer(p, {"[UNK]": 0, "hello": 1, "<|endoftext|>": 2})
    data = json.loads(tok.read_text())
    data["model"]["vocab"]["huge"] = 2**32 + 5
    tok.write_text(json.dumps(data))
    (p.tmp / "a.txt").write_text("hello huge hello " * 50)
    before = p.files()
    r = p.cli("data", "prepare", "a.txt", "--out", "ds", "--tokenizer", tok)
    refused(r)
    nothing_left(p, before, p.tmp / "ds")


@case("data", "one big text file gets a validation split")
def _(p: Probe) -> None:
    text = "".join(f"Paragraph {i}: " + "the quick brown fox jumps over the lazy dog. " * 20 + "\n\n"
                   for i in range(400))
    (p.tmp / "book.txt").write_text(text)
    succeeded(p.cli("data", "prepare", "book.txt", "--out", "ds", "--val-fraction", "0.05"))
    meta = json.loads((p.tmp / "ds" / "meta.json").read_text())
    expect(meta["splits"]["val"]["tokens"] > 0 and meta["splits"]["train"]["tokens"] > 0, "wrong",
           f"splits: train {meta['splits']['train']['tokens']}, val {meta['splits']['val']['tokens']} tokens")
    r = p.cli("plan", *TINY_PLAN, f"data.datasets=[{p.tmp / 'ds'}]")
    succeeded(r)


@case("data", "one short document: an empty split is refused at plan time, not in the worker")
def _(p: Probe) -> None:
    (p.tmp / "one.txt").write_text("just one short note that is long enough for a sequence of thirty-two. " * 3)
    r = p.cli("data", "prepare", "one.txt", "--out", "ds", "--val-fraction", "0.01")
    if r.code != 0:  # refusing the dataset outright is an answer too
        refused(r)
        return
    meta = json.loads((p.tmp / "ds" / "meta.json").read_text())
    if all(meta["splits"][s]["tokens"] > 32 for s in ("train", "val")):
        return
    refused(p.cli("plan", *TINY_PLAN, f"data.datasets=[{p.tmp / 'ds'}]"), "split")


@case("data", "a folder holding a gzip file next to text")
def _(p: Probe) -> None:
    root = zen(p)
    with gzip.open(root / "more.txt.gz", "wt") as f:
        f.write("compressed text " * 100)
    os.rename(root / "more.txt.gz", root / "more.txt")  # a .txt name on gzip bytes
    r = p.cli("data", "prepare", "text", "--out", "ds")
    if r.code == 0:  # acceptable only when the text inside was read (byte tokens: the text is in the shards)
        raw = np.concatenate([shard_ids(p.tmp / "ds", s) for s in ("train", "val")]).astype(np.uint8).tobytes()
        expect(b"compressed text" in raw, "wrong", "the gzip bytes were tokenized as text")
        return
    refused(r, "more.txt")


@case("data", "a glob that matches a .gz file")
def _(p: Probe) -> None:
    zen(p)
    with gzip.open(p.tmp / "text" / "x.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": "hello " * 50}) + "\n")
    r = p.cli("data", "prepare", str(p.tmp / "text" / "*"), "--out", "ds")
    if r.code == 0:
        raw = np.concatenate([shard_ids(p.tmp / "ds", s) for s in ("train", "val")]).astype(np.uint8).tobytes()
        expect(b"hello hello" in raw, "wrong", "the gzip bytes were tokenized as text")
        return
    refused(r, "x.jsonl.gz")


@case("data", "--out under a regular file")
def _(p: Probe) -> None:
    zen(p)
    (p.tmp / "afile").write_text("mine")
    before = p.files()
    refused(p.cli("data", "prepare", "text", "--out", "afile/ds"), "afile")
    nothing_left(p, before)


@case("data", "--out is an existing file")
def _(p: Probe) -> None:
    zen(p)
    (p.tmp / "afile").write_text("mine")
    before = p.files()
    refused(p.cli("data", "prepare", "text", "--out", "afile"))
    nothing_left(p, before)


@case("data", "--out is the input folder itself")
def _(p: Probe) -> None:
    zen(p)
    before = p.files()
    r = p.cli("data", "prepare", "text", "--out", "text")
    refused(r)
    nothing_left(p, before)


@case("data", "a parquet text column of integers")
def _(p: Probe) -> None:
    code = ("import pyarrow as pa, pyarrow.parquet as pq, sys\n"
            "pq.write_table(pa.table({'text': list(range(50))}), sys.argv[1])")
    expect(p.python(code, str(p.tmp / "n.parquet")).code == 0, "wrong", "pyarrow could not write the file")
    before = p.files()
    refused(p.cli("data", "prepare", "n.parquet", "--out", "ds"), "n.parquet", "text")
    nothing_left(p, before, p.tmp / "ds")


@case("data", "a parquet text column of lists and nulls")
def _(p: Probe) -> None:
    code = ("import pyarrow as pa, pyarrow.parquet as pq, sys\n"
            "pq.write_table(pa.table({'text': [['a', 'b'], None, ['c']]}), sys.argv[1])")
    expect(p.python(code, str(p.tmp / "l.parquet")).code == 0, "wrong", "pyarrow could not write the file")
    before = p.files()
    refused(p.cli("data", "prepare", "l.parquet", "--out", "ds"), "l.parquet")
    nothing_left(p, before, p.tmp / "ds")


@case("data", "a FIFO given as the input")
def _(p: Probe) -> None:
    os.mkfifo(p.tmp / "pipe.txt")
    refused(p.cli("data", "prepare", "pipe.txt", "--out", "ds", timeout=30), "pipe.txt")


@case("data", "a FIFO inside an input folder")
def _(p: Probe) -> None:
    zen(p)
    os.mkfifo(p.tmp / "text" / "pipe.txt")
    r = p.cli("data", "prepare", "text", "--out", "ds", timeout=30)
    if r.code == 0:
        return  # skipped (only regular files are inputs) is an answer
    refused(r, "pipe.txt")


@case("data", "a symlink loop inside an input folder")
def _(p: Probe) -> None:
    zen(p)
    (p.tmp / "text" / "loop").symlink_to(p.tmp / "text")
    r = p.cli("data", "prepare", "text", "--out", "ds", timeout=60)
    succeeded(r) if r.code == 0 else refused(r)


@case("data", "a .jsonl whose 3rd line is not JSON: nothing left behind")
def _(p: Probe) -> None:
    lines = [json.dumps({"text": f"doc {i} " * 30}) for i in range(5)]
    lines[2] = "{not json"
    (p.tmp / "d.jsonl").write_text("\n".join(lines) + "\n")
    before = p.files()
    refused(p.cli("data", "prepare", "d.jsonl", "--out", "ds"), "d.jsonl")
    nothing_left(p, before, p.tmp / "ds")
    refused(p.cli("data", "prepare", "d.jsonl", "--out", "ds"), "d.jsonl")  # the same answer, not "unfinished"


@case("data", "a refused prepare into an existing empty folder leaves the folder as it was")
def _(p: Probe) -> None:
    (p.tmp / "ds").mkdir()
    (p.tmp / "d.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    refused(p.cli("data", "prepare", "d.jsonl", "--out", "ds"), "text")
    expect((p.tmp / "ds").is_dir() and not any((p.tmp / "ds").iterdir()), "wrong",
           f"ds holds {sorted(x.name for x in (p.tmp / 'ds').iterdir())}")


@case("data", "--text-field naming a list (chat messages)")
def _(p: Probe) -> None:
    (p.tmp / "c.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    before = p.files()
    refused(p.cli("data", "prepare", "c.jsonl", "--out", "ds", "--text-field", "messages"), "messages")
    nothing_left(p, before, p.tmp / "ds")


@case("data", "an empty input file")
def _(p: Probe) -> None:
    (p.tmp / "e.txt").write_text("")
    before = p.files()
    refused(p.cli("data", "prepare", "e.txt", "--out", "ds"))
    nothing_left(p, before, p.tmp / "ds")


@case("data", "a glob that matches nothing")
def _(p: Probe) -> None:
    refused(p.cli("data", "prepare", "nothing/*.txt", "--out", "ds"), "nothing")
    expect(not (p.tmp / "ds").exists(), "wrong", "left ds behind")


@case("data", "--val-fraction 1.5, -0.5 and nan (1 is an eval-only set)")
def _(p: Probe) -> None:
    zen(p)
    for value in ("1.5", "-0.5", "nan"):
        refused(p.cli("data", "prepare", "text", "--out", "ds", "--val-fraction", value), "val-fraction")
    expect(not (p.tmp / "ds").exists(), "wrong", "left ds behind")


@case("data", "--workers 0 and --shard-tokens 0")
def _(p: Probe) -> None:
    zen(p)
    r = p.cli("data", "prepare", "text", "--out", "ds", "--workers", "0")
    succeeded(r) if r.code == 0 else refused(r, "workers")
    refused(p.cli("data", "prepare", "text", "--out", "ds2", "--shard-tokens", "0"), "shard-tokens")


@case("data", "text with invalid UTF-8 and NUL bytes is refused, not decoded with replacements")
def _(p: Probe) -> None:
    # Decoding with replacement characters would change the text silently: trainctl refuses it, naming the file
    # and the fix (iconv), and writes nothing.
    (p.tmp / "bad.txt").write_bytes(b"caf\xe9 \xff\xfe ok \x00 nul " * 200)
    refused(p.cli("data", "prepare", "bad.txt", "--out", "ds"), "bad.txt")
    expect(not (p.tmp / "ds").exists(), "wrong", "a refused prepare left ds/ behind")


@case("data", "a .jsonl with a UTF-8 byte-order mark")
def _(p: Probe) -> None:
    body = "\n".join(json.dumps({"text": f"doc {i} " * 30}) for i in range(20)) + "\n"
    (p.tmp / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + body.encode())
    r = p.cli("data", "prepare", "bom.jsonl", "--out", "ds")
    succeeded(r) if r.code == 0 else refused(r, "bom.jsonl")


@case("data", "two prepares into one --out at the same time")
def _(p: Probe) -> None:
    (p.tmp / "big.jsonl").write_text("".join(json.dumps({"text": f"doc {i} " * 200}) + "\n" for i in range(4000)))
    argv = [sys.executable, "-m", "trainctl.cli", "data", "prepare", "big.jsonl", "--out", "ds", "--workers", "1"]
    procs = [p.popen(argv) for _ in range(2)]
    outs = [proc.communicate(timeout=180) for proc in procs]
    codes = sorted(proc.returncode for proc in procs)
    expect(not any("Traceback" in o + e for o, e in outs), "traceback", "a traceback from one of the two")
    expect(codes in ([0, 2], [0, 0]), "wrong", f"exit codes {codes}: {[e[-200:] for _, e in outs]}")
    expect((p.tmp / "ds" / "meta.json").is_file(), "wrong", "no finished dataset")


@case("data", "Ctrl-C mid-way, a shard truncated, then the same command: byte-identical to one clean run")
def _(p: Probe) -> None:
    root = p.tmp / "many"
    root.mkdir()
    for i in range(400):  # a text file is one piece: the prepare records its progress after each
        (root / f"doc{i:03d}.txt").write_text(f"document {i}: " + "lorem ipsum dolor sit amet " * 2000)
    args = ["data", "prepare", "many", "--workers", "1", "--shard-tokens", "200000"]
    succeeded(p.cli(*args, "--out", "clean", timeout=240))
    argv = [sys.executable, "-m", "trainctl.cli", *args, "--out", "ds"]
    proc = p.popen(argv)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list((p.tmp / "ds").glob("train-*.bin"))) < 2:
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
    proc.communicate(timeout=120)
    shards = sorted((p.tmp / "ds").glob("train-*.bin"))
    if (p.tmp / "ds" / "meta.json").exists() or not shards:
        raise Verdict("wrong", "the prepare finished before it could be interrupted (harness timing)")
    os.truncate(shards[0], shards[0].stat().st_size // 2)
    succeeded(p.cli(*args, "--out", "ds", timeout=240))
    clean, resumed = p.files(p.tmp / "clean"), p.files(p.tmp / "ds")
    binaries = sorted(k for k in clean if k.endswith(".bin"))
    expect(binaries == sorted(k for k in resumed if k.endswith(".bin")), "wrong", "other shard files")
    differ = [k for k in binaries if clean[k] != resumed[k]]
    expect(not differ, "data loss", f"shards differ from a clean run: {differ[:3]}")


@case("data", "plan on a dataset whose shard was truncated after prepare")
def _(p: Probe) -> None:
    zen(p)
    succeeded(p.cli("data", "prepare", "text", "--out", "ds", "--val-fraction", "0.3"))
    shard = p.tmp / "ds" / "train-00000.bin"
    os.truncate(shard, shard.stat().st_size - 3)
    refused(p.cli("plan", *TINY_PLAN, f"data.datasets=[{p.tmp / 'ds'}]"), "train-00000.bin")


@case("data", "plan on a dataset whose meta.json is not JSON")
def _(p: Probe) -> None:
    zen(p)
    succeeded(p.cli("data", "prepare", "text", "--out", "ds", "--val-fraction", "0.3"))
    (p.tmp / "ds" / "meta.json").write_text("{oops")
    refused(p.cli("plan", *TINY_PLAN, f"data.datasets=[{p.tmp / 'ds'}]"), "meta.json")


@case("data", "blending two datasets prepared with different tokenizers")
def _(p: Probe) -> None:
    zen(p)
    succeeded(p.cli("data", "prepare", "text", "--out", "bytes", "--val-fraction", "0.3"))
    succeeded(p.cli("data", "prepare", "text", "--out", "bpe", "--train-tokenizer", "--vocab-size", "300",
                    "--val-fraction", "0.3"))
    r = p.cli("plan", *TINY_PLAN, "model.vocab_size=512", f"data.datasets=[{p.tmp / 'bytes'},{p.tmp / 'bpe'}]")
    refused(r, "tokenizer")


@case("data", "a dataset whose vocabulary exceeds the model's")
def _(p: Probe) -> None:
    zen(p)
    succeeded(p.cli("data", "prepare", "text", "--out", "bpe", "--train-tokenizer", "--vocab-size", "400",
                    "--val-fraction", "0.3"))
    refused(p.cli("plan", *TINY_PLAN, f"data.datasets=[{p.tmp / 'bpe'}]"), "vocab")


@case("data", "data.datasets naming an unfinished prepare (no meta.json)")
def _(p: Probe) -> None:
    (p.tmp / "half").mkdir()
    (p.tmp / "half" / "train-00000.bin").write_bytes(b"\0\1" * 100)
    refused(p.cli("plan", *TINY_PLAN, f"data.datasets=[{p.tmp / 'half'}]"), "half")


@case("data", "a flat token file of odd size and ids past the vocabulary")
def _(p: Probe) -> None:
    np.asarray([1, 2, 300] * 100, dtype=np.uint16).tofile(p.tmp / "t.bin")
    (p.tmp / "odd.bin").write_bytes(b"\1" * 101)
    r = p.cli("launch", "recipe=tiny_cpu", "data=memmap", "train.seq_len=32", "data.train_path=t.bin",
              "data.val_path=odd.bin", "--dry-run")
    refused(r, "t.bin", "odd.bin", one_line=False)
    expect(not (p.tmp / "runs").exists(), "wrong", "a run directory was written")


SAVE_ROWS = ("import datasets, json, sys; "
             "datasets.Dataset.from_list(json.loads(sys.argv[1])).save_to_disk(sys.argv[2])")


@case("data", "data prepare --hf: a saved dataset without the named field")
def _(p: Probe) -> None:
    r = p.python(SAVE_ROWS, json.dumps([{"body": "some text", "n": 1}] * 5), str(p.tmp / "rows"))
    expect(r.code == 0, "wrong", f"could not save the test dataset: {r.brief()}")
    before = p.files()
    refused(p.cli("data", "prepare", "--hf", "rows", "--out", "ds"), "'text'", "body, n")
    nothing_left(p, before, p.tmp / "ds")


@case("data", "data prepare --hf: a Hub name not in the cache, offline")
def _(p: Probe) -> None:
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(p.tmp / "hf-home")}
    refused(p.cli("data", "prepare", "--hf", "someorg/nothing-here", "--out", "ds", env=env), "offline",
            "load_dataset")


@case("data", "data prepare --hf: a saved dataset with no rows")
def _(p: Probe) -> None:
    r = p.python("import datasets, sys; datasets.Dataset.from_dict({'text': []}).save_to_disk(sys.argv[1])",
                 str(p.tmp / "empty"))
    expect(r.code == 0, "wrong", f"could not save the test dataset: {r.brief()}")
    before = p.files()
    refused(p.cli("data", "prepare", "--hf", "empty", "--out", "ds"), "/empty has no rows", absent=("IndexError",))
    nothing_left(p, before, p.tmp / "ds")
