#!/usr/bin/env python3
"""The chunked loss head (models/loss_head.py) next to the dense one: forward + backward time and peak memory.

    python scripts/bench_loss_head.py [--device cpu|cuda] [--sizes 16384x2048x128256 8192x4096x128256]
                                      [--quick] [--dtype fp32|bf16] [--body auto|eager|compiled]
                                      [--chunks 1024 4096 all] [--dense-compiled auto|on|off]
                                      [--warmup 1] [--repeats 3] [--json OUT]

Each size is TOKENSxDIMxVOCAB: hidden [tokens, dim] and an output weight [vocab, dim], both requiring
gradients, the targets with one token in 64 ignored. The dense arm is F.linear + F.cross_entropy (the
softmax in fp32, as the model's dense path); the chunked arm is `linear_cross_entropy`. Both take the
gradient of the mean loss (summed, divided by the tokens, as the trainer's normalization does).
The default sizes are the real heads: Llama 3.2 1B at 8 x 2048 tokens and Llama 3.1 8B's width at 1 x 8192.
The chunked arm runs the chunk size the trainer would pick with no headroom (core/loss_head.planned_chunk_tokens);
--chunks adds a sweep of other sizes ("all": one chunk). The compiled dense arm is torch.compile of the dense one
(what torchtitan runs; by default on CUDA only, where compiling it takes seconds): the chunked head's targets are
set against it (time <= 1.05x, peak <= 0.5x).

Time: the median of --repeats forward + backward passes after --warmup, synchronized on CUDA, the two
arms interleaved so that load from others on a shared machine falls on both.
Peak: how far memory rises above what is allocated before the pass (the inputs and weight), gradients
included. CUDA: torch.cuda.max_memory_allocated. CPU: the largest running sum of the torch CPU allocator's
allocation and free events recorded by torch.profiler(profile_memory=True), in a pass of its own so the
profiler does not slow the timed ones. tracemalloc does not see torch's allocator, and RSS is not honest
here: glibc keeps freed pages mapped, so an RSS delta depends on what ran before.
--body forces the chunk body eager or compiled (default: the head's own choice, loss_head.compiled).
Prints per size `ratio time chunked/dense X` and `ratio peak chunked/dense Y`; --json writes every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainctl.core import loss_head as rule  # noqa: E402
from trainctl.models import loss_head  # noqa: E402
from trainctl.models.loss_head import IGNORE_INDEX, dense_loss_sum, linear_cross_entropy  # noqa: E402
from trainctl.train.observe.peak_memory import profiled_rise, stderr_silenced  # noqa: E402

DEFAULT_SIZES = ["16384x2048x128256", "8192x4096x128256"]
QUICK_SIZE = "512x128x4096"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_size(text: str) -> tuple[int, int, int]:
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise SystemExit(f"error: --sizes: {text!r} is not TOKENSxDIMxVOCAB; e.g. 4096x2048x32768")
    return int(parts[0]), int(parts[1]), int(parts[2])


def inputs(size: tuple[int, int, int], device: str, dtype: torch.dtype):
    tokens, dim, vocab = size
    gen = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(tokens, dim, generator=gen).to(device, dtype).requires_grad_()
    weight = (torch.randn(vocab, dim, generator=gen) / dim**0.5).to(device, dtype).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    targets[::64] = IGNORE_INDEX
    return hidden, weight, targets.to(device)


def dense(hidden, weight, targets):
    return dense_loss_sum(F.linear(hidden, weight), targets)


def chunked_arm(chunk: int):
    def chunked(hidden, weight, targets):
        return linear_cross_entropy(hidden, weight, targets, chunk)

    return chunked


def planned_chunk(size: tuple[int, int, int], dtype: torch.dtype) -> int:
    """The trainer's chunk for this head with no headroom under its step's peak (the plan may grant more)."""
    tokens, dim, vocab = size
    return rule.planned_chunk_tokens(vocab, dim, tokens, 0, torch.finfo(dtype).bits // 8)


def one_pass(arm, hidden, weight, targets) -> torch.Tensor:
    hidden.grad = weight.grad = None
    loss = arm(hidden, weight, targets)
    (loss / targets.numel()).backward()
    return loss.detach()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_arms(arms: dict, args, device: str, warmup: int, repeats: int) -> dict[str, list[float]]:
    """Seconds per pass of each arm, the arms interleaved (their order alternating) so that a machine
    shared with others slows both alike."""
    for _ in range(warmup):
        for arm in arms.values():
            one_pass(arm, *args)
    times = {name: [] for name in arms}
    for repeat in range(repeats):
        for name in (list(arms) if repeat % 2 == 0 else list(arms)[::-1]):
            sync(device)
            start = time.perf_counter()
            one_pass(arms[name], *args)
            sync(device)
            times[name].append(time.perf_counter() - start)
    return times


def peak_arm(arm, args, device: str) -> int:
    hidden, weight, _ = args
    hidden.grad = weight.grad = None
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        one_pass(arm, *args)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    from torch.profiler import ProfilerActivity, profile

    with stderr_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        one_pass(arm, *args)
    return profiled_rise(prof)


def agreement(args, chunk: int) -> dict:
    """How far the chunked loss and gradients are from the dense ones (relative to the dense maxima)."""
    hidden, weight, targets = args
    want = [one_pass(dense, *args), hidden.grad.clone(), weight.grad.clone()]
    got = [one_pass(chunked_arm(chunk), *args), hidden.grad, weight.grad]
    names = ("loss", "grad_hidden", "grad_weight")
    out = {n: ((g.float() - w.float()).abs().max() / w.float().abs().max()).item()
           for n, g, w in zip(names, got, want, strict=True)}
    hidden.grad = weight.grad = None
    return out


def arms_of(size, dtype, sweep: list[str], dense_compiled: bool) -> tuple[dict, dict[str, int]]:
    """The arms to time by name, and the chunk of each chunked one ("chunked" is the trainer's choice)."""
    chunks = {"chunked": planned_chunk(size, dtype)}
    for text in sweep:
        chunk = size[0] if text == "all" else int(text)
        chunks.setdefault(f"chunked_{chunk}", chunk)
    arms = {"dense": dense, **{name: chunked_arm(chunk) for name, chunk in chunks.items()}}
    if dense_compiled:
        arms["dense_compiled"] = torch.compile(dense)
    return arms, chunks


def bench_size(size, device: str, dtype: torch.dtype, warmup: int, repeats: int, sweep: list[str] = (),
               dense_compiled: bool = False) -> dict:
    args = inputs(size, device, dtype)
    arms, chunks = arms_of(size, dtype, list(sweep), dense_compiled)
    result = {"tokens": size[0], "dim": size[1], "vocab": size[2], "chunk_tokens": chunks["chunked"],
              "compiled": loss_head.compiled(device), "dense_compiled": dense_compiled}
    for name, times in time_arms(arms, args, device, warmup, repeats).items():
        result[f"{name}_times_s"] = times
        result[f"{name}_time_s"] = statistics.median(times)
        result[f"{name}_peak_bytes"] = peak_arm(arms[name], args, device)
    result["ratio_time"] = result["chunked_time_s"] / result["dense_time_s"]
    result["ratio_peak"] = result["chunked_peak_bytes"] / result["dense_peak_bytes"]
    if dense_compiled:
        result["ratio_time_vs_compiled"] = result["chunked_time_s"] / result["dense_compiled_time_s"]
        result["ratio_peak_vs_compiled"] = result["chunked_peak_bytes"] / result["dense_compiled_peak_bytes"]
    result["sweep"] = [{"chunk_tokens": chunk, "time_s": result[f"{name}_time_s"],
                        "peak_bytes": result[f"{name}_peak_bytes"]} for name, chunk in sorted(
                            chunks.items(), key=lambda item: item[1])]
    result["relative_error"] = agreement(args, chunks["chunked"])
    return result


def report(result: dict) -> None:
    size = f"{result['tokens']}x{result['dim']}x{result['vocab']}"
    print(f"{size}: chunks of {result['chunk_tokens']} tokens, compiled body: {result['compiled']}")
    names = ["dense"] + (["dense_compiled"] if result["dense_compiled"] else [])
    for name in names + ["chunked"]:
        ms, mib = result[f"{name}_time_s"] * 1e3, result[f"{name}_peak_bytes"] / 2**20
        print(f"  {name:15s} {ms:9.1f} ms  peak {mib:9.1f} MiB")
    for row in result["sweep"]:
        ms, mib = row["time_s"] * 1e3, row["peak_bytes"] / 2**20
        print(f"  chunk {row['chunk_tokens']:>7d}   {ms:9.1f} ms  peak {mib:9.1f} MiB")
    print(f"  relative error: {', '.join(f'{k} {v:.1e}' for k, v in result['relative_error'].items())}")
    print(f"ratio time chunked/dense {result['ratio_time']:.2f}  ({size})")
    print(f"ratio peak chunked/dense {result['ratio_peak']:.2f}  ({size})")
    if result["dense_compiled"]:
        print(f"ratio time chunked/compiled dense {result['ratio_time_vs_compiled']:.2f}  ({size}; target <= 1.05)")
        print(f"ratio peak chunked/compiled dense {result['ratio_peak_vs_compiled']:.2f}  ({size}; target <= 0.5)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", nargs="+", default=None, help="TOKENSxDIMxVOCAB ...")
    parser.add_argument("--quick", action="store_true", help=f"one small size ({QUICK_SIZE}), one repeat")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on cuda, fp32 on cpu")
    parser.add_argument("--body", choices=["auto", "eager", "compiled"], default="auto",
                        help="the chunk body: auto (compiled on CUDA where Triton can build), or forced")
    parser.add_argument("--chunks", nargs="*", default=[], help="chunk sizes to sweep (tokens, or 'all')")
    parser.add_argument("--dense-compiled", choices=["auto", "on", "off"], default="auto",
                        help="time torch.compile(dense) too (auto: on CUDA)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    opts = parser.parse_args(argv)
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device: cuda is not available here; --device cpu")
    loss_head.COMPILE = {"auto": None, "eager": False, "compiled": True}[opts.body]
    sizes = [parse_size(s) for s in (opts.sizes or ([QUICK_SIZE] if opts.quick else DEFAULT_SIZES))]
    repeats = 1 if opts.quick else max(1, opts.repeats)
    dtype = DTYPES[opts.dtype or ("bf16" if opts.device == "cuda" else "fp32")]
    bad = [c for c in opts.chunks if c != "all" and not (c.isdigit() and int(c) > 0)]
    if bad:
        raise SystemExit(f"error: --chunks: {bad[0]!r} is not a positive number of tokens or 'all'")
    compile_dense = opts.dense_compiled == "on" or (opts.dense_compiled == "auto" and opts.device == "cuda")
    results = []
    for size in sizes:
        results.append(bench_size(size, opts.device, dtype, max(0, opts.warmup), repeats, opts.chunks, compile_dense))
        report(results[-1])
    if opts.json:
        name = torch.cuda.get_device_name() if opts.device == "cuda" else "cpu"
        meta = {"device": opts.device, "device_name": name, "body": opts.body,
                "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
                "threads": torch.get_num_threads(), "warmup": opts.warmup, "repeats": repeats}
        opts.json.write_text(json.dumps({**meta, "sizes": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
