#!/usr/bin/env python3
"""`trainctl data prepare` throughput (MB/s of text) next to the `tokenizers` library's own batch encoding.

    python scripts/bench_prepare.py [--input PATH ... | --generate-mb 50] [--tokenizer tokenizer.json]
                                    [--workers N] [--json]

Both arms tokenize the same documents with the same tokenizer.json (given, or a BPE of 8k trained here
on the input first; its training time is reported apart). `tokenizers` alone: `Tokenizer.encode_batch`
over every document, in one process with the library's own threads, nothing written. `data prepare`:
the whole job (read, tokenize in worker processes, split, write shards, hash the sources, meta.json).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

WORDS = 5000


def generate(folder: Path, megabytes: float, seed: int = 0) -> list[Path]:
    """Text files of made-up words, about `megabytes` in all: 1 MB files of 2-8 kB documents separated by lines."""
    rng = random.Random(seed)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(WORDS)]
    folder.mkdir(parents=True, exist_ok=True)
    files, left, index = [], int(megabytes * 1e6), 0
    while left > 0:
        size, docs = min(left, 1_000_000), []
        while sum(len(d) + 1 for d in docs) < size:
            docs.append(" ".join(rng.choices(vocab, k=rng.randint(300, 1300))))
        path = folder / f"part-{index:04d}.jsonl"
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        files.append(path)
        left -= size
        index += 1
    return files


def texts_of(files: list[Path]) -> list[str]:
    from trainctl.data.inputs import documents

    return [t for f in files for t in documents(f, "text")]


def bench(inputs: list[Path], tokenizer: str | None, workers: int | None, work: Path) -> dict:
    from tokenizers import Tokenizer

    from trainctl.data.inputs import expand_inputs
    from trainctl.data.prepare import prepare
    from trainctl.data.tokenizer import train_bpe

    files = expand_inputs([str(p) for p in inputs])
    texts = texts_of(files)
    text_mb = sum(len(t.encode()) for t in texts) / 1e6
    train_s = 0.0
    if tokenizer is None:
        start = time.perf_counter()
        tokenizer = str(train_bpe(iter(texts), 8192, work / "bpe.json").file)
        train_s = time.perf_counter() - start
    tok = Tokenizer.from_file(tokenizer)
    start = time.perf_counter()
    total = sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
    alone_s = time.perf_counter() - start
    start = time.perf_counter()
    meta = prepare([str(p) for p in inputs], work / "out", tokenizer=tokenizer, val_fraction=0.01, workers=workers,
                   eos_token="<|endoftext|>" if train_s else None)
    prepare_s = time.perf_counter() - start
    written = meta.splits["train"].tokens + meta.splits["val"].tokens
    documents = meta.splits["train"].documents + meta.splits["val"].documents
    return {"text_mb": round(text_mb, 2), "documents": documents, "tokens": written - documents,
            "tokens_alone": total, "workers": workers or os.cpu_count(), "cpus": os.cpu_count(),
            "tokenizer_train_s": round(train_s, 2), "tokenizers_alone_s": round(alone_s, 3),
            "tokenizers_alone_mb_s": round(text_mb / alone_s, 2), "prepare_s": round(prepare_s, 3),
            "prepare_mb_s": round(text_mb / prepare_s, 2), "ratio": round(alone_s / prepare_s, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", type=Path, help="text files or folders (default: generated text)")
    parser.add_argument("--generate-mb", type=float, default=20.0, help="generated text when no --input (MB)")
    parser.add_argument("--tokenizer", help="a tokenizer.json (default: train a BPE of 8192 on the input)")
    parser.add_argument("--workers", type=int, help="data prepare's processes (default: one per core)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as tmp:
        work = Path(tmp)
        inputs = args.input or generate(work / "text", args.generate_mb)
        figures = bench(inputs, args.tokenizer, args.workers, work)
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    print(f"{figures['text_mb']} MB of text, {figures['documents']} documents, {figures['tokens']} tokens, "
          f"{figures['workers']} workers on {figures['cpus']} CPUs")
    print(f"tokenizers encode_batch alone: {figures['tokenizers_alone_s']} s = {figures['tokenizers_alone_mb_s']} MB/s")
    print(f"trainctl data prepare:         {figures['prepare_s']} s = {figures['prepare_mb_s']} MB/s "
          f"(x{figures['ratio']} of tokenizers alone)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
