"""torchtitan's own training on the shape of a trainctl recipe, next to bench_loop's trainctl figure (issue 22).

    python scripts/bench_titan.py --device cuda --json $OUT/titan.json --loop $OUT/loop.json   # llama1b_bench
    python scripts/bench_titan.py --device cpu --warmup 2 --steps 2 --log-freq 1 model=tiny train.seq_len=64
    python scripts/bench_titan.py --dry-run ...             # print torchtitan's config and command; run nothing

The recipe (default llama1b_bench, with trainctl overrides) gives the shape: dims, heads, kv heads, FFN width,
vocabulary, sequence length, micro-batch x accumulation, compute precision (bf16 autocast over fp32 weights on
one device, as torchtitan does without FSDP), compile, activation checkpointing, AdamW settings and clipping.
It becomes a torchtitan TOML job config, and torchtitan's Trainer (torchtitan.train.main) runs it under
torchrun on one device, registered as a train spec of its own: torchtitan's Llama 3 model, parallelize
function, loss, optimizer and schedule, with two swaps: synthetic tokens (one fixed batch, as bench_loop
feeds both its arms; no tokenizer, so HF `datasets` need not be carried) and a metrics logger that appends
each of torchtitan's metric records to a JSON-lines file. Tokens/s is the median of torchtitan's own `tps`
over the log intervals after warm-up (the first covers compilation); MFU and TFLOPS are torchtitan's (its
formula: 6 x (params - embedding) + 6 x layers x heads x 2 x head_dim x seq per token, full attention,
against its bf16 peak); peak memory is the largest `max_active` (allocated, ~ max_memory_allocated).

Known differences, recorded in the JSON: torchtitan's Llama 3 does not tie the output projection to the
embedding (Llama 3.2 1B and trainctl's llama3_1b do): the same matmul FLOPs, 0.26 B more parameters in AdamW
and memory; its attention is SDPA with PyTorch's default kernel choice (trainctl tries cuDNN first).

--device cpu is the rehearsal (scripts/gpu_proof.sh --rehearse). The torchtitan side is scripts/titan_worker.py;
this side imports neither torch nor torchtitan.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

TRAIN_SPEC = "trainctl_llama3"  # the train spec (model.name) titan_worker.py registers with torchtitan
FLAVOR = "recipe"
WORKER = Path(__file__).resolve().with_name("titan_worker.py")
TIED_NOTE = ("torchtitan's llama3 keeps a separate output projection; the recipe ties it to the embedding: "
             "same matmul FLOPs, vocab x dim more parameters in AdamW and memory on torchtitan's side")


# --- the parent: the recipe -> torchtitan's config; run; read torchtitan's metrics; compare ---

def ffn_args(dim: int, ffn_dim: int) -> dict:
    """torchtitan's FeedForward width is multiple_of * ceil(int(m * int(8 * dim / 3)) / multiple_of): the
    arguments that give exactly `ffn_dim` (the worker checks the built model against it)."""
    base = int(2 * 4 * dim / 3)
    for multiple_of in (1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1):
        for multiplier in (None, ffn_dim / base):
            hidden = base if multiplier is None else int(multiplier * base)
            if multiple_of * -(-hidden // multiple_of) == ffn_dim:
                return {"multiple_of": multiple_of, "ffn_dim_multiplier": multiplier}
    raise ValueError(f"no torchtitan FeedForward arguments give width {ffn_dim} at dim {dim}")


def titan_model_args(model) -> dict:
    """TransformerModelArgs keywords for a trainctl ModelConfig."""
    return {"dim": model.dim, "n_layers": model.n_layers, "n_heads": model.n_heads, "n_kv_heads": model.n_kv_heads,
            "vocab_size": model.vocab_size, "norm_eps": model.norm_eps, "rope_theta": model.rope_theta,
            **ffn_args(model.dim, model.ffn_dim)}


def titan_job(cfg, device: str, warmup: int, steps: int, log_freq: int, dump_folder: Path,
              local_batch: int | None = None) -> dict:
    """The torchtitan job config (TOML sections) for the recipe: one device, no checkpoints, no validation;
    `local_batch` (a divisor of the recipe's micro-batch) accumulates to the recipe's tokens per step."""
    t, precision = cfg.train, cfg.precision
    if precision.fp8:
        raise ValueError("precision.fp8: bench_titan compares bf16/fp32 runs; torchtitan's float8 is not mapped")
    if t.activation_checkpointing not in ("none", "full"):
        raise ValueError(f"train.activation_checkpointing={t.activation_checkpointing}: only none and full map "
                         "onto torchtitan's modes unchanged")
    mixed = {"bf16": "bfloat16", "fp32": "float32"}.get(precision.compute_dtype)
    if mixed is None:
        raise ValueError(f"precision.compute_dtype={precision.compute_dtype}: torchtitan trains bf16 or fp32")
    o = cfg.optim
    return {
        "job": {"dump_folder": str(dump_folder), "description": f"trainctl {cfg.recipe} shape (bench_titan)"},
        "profiling": {"enable_profiling": False, "enable_memory_snapshot": False},
        "metrics": {"log_freq": log_freq, "enable_tensorboard": False, "enable_wandb": False,
                    "disable_color_printing": True},
        "model": {"name": TRAIN_SPEC, "flavor": FLAVOR},
        "optimizer": {"name": "AdamW", "lr": o.lr, "beta1": o.beta1, "beta2": o.beta2, "eps": o.eps,
                      "weight_decay": o.weight_decay, "implementation": "fused" if device == "cuda" else "foreach"},
        "lr_scheduler": {"warmup_steps": warmup},
        "training": {"local_batch_size": local_batch or t.micro_batch,
                     "global_batch_size": t.micro_batch * t.grad_accum,
                     "seq_len": t.seq_len, "max_norm": o.grad_clip, "steps": warmup + steps,
                     "mixed_precision_param": mixed, "dtype": "float32", "gc_freq": t.gc_every},
        "parallelism": {"data_parallel_shard_degree": 1, "data_parallel_replicate_degree": 1},
        "activation_checkpoint": {"mode": t.activation_checkpointing},
        "compile": {"enable": bool(t.compile), "components": ["model", "loss"]},
        "checkpoint": {"enable": False},
        "validation": {"enable": False},
        "debug": {"seed": t.seed},
    }


def to_toml(sections: dict) -> str:
    """TOML for flat sections of str, bool, int, float and lists of str (all a job config needs here)."""
    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)  # a JSON string is a TOML basic string
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        raise TypeError(f"no TOML for {v!r}")
    return "\n".join(f"[{name}]\n" + "".join(f"{k} = {value(v)}\n" for k, v in body.items())
                     for name, body in sections.items())


def summarize(records: list[dict], warmup: int) -> dict:
    """torchtitan's metric records -> the figures: medians over the intervals that end after warm-up."""
    timed = [r for r in records if r["step"] > warmup and r.get("throughput(tps)") is not None]
    if not timed:
        raise ValueError(f"no torchtitan metrics after warm-up step {warmup} (records at steps "
                         f"{[r['step'] for r in records]}): raise --steps or lower --log-freq")
    gib = [r.get("memory/max_active(GiB)", -1) for r in records]
    reserved = [r.get("memory/max_reserved(GiB)", -1) for r in records]
    return {
        "tokens_per_s": statistics.median(r["throughput(tps)"] for r in timed),
        "tokens_per_s_intervals": [round(r["throughput(tps)"], 1) for r in timed],
        "tflops": statistics.median(r["tflops"] for r in timed),
        "mfu_pct": statistics.median(r["mfu(%)"] for r in timed),
        # torchtitan resets the peaks at every log: the run's peak is the largest interval's (-1: not measured)
        "peak_active_gib": max(gib) if max(gib) >= 0 else None,
        "peak_reserved_gib": max(reserved) if max(reserved) >= 0 else None,
        "loss_first_last": [records[0]["loss_metrics/global_avg_loss"], records[-1]["loss_metrics/global_avg_loss"]],
        "flops_per_token": records[-1].get("flops_per_token"), "peak_flops": records[-1].get("peak_flops"),
        "timed_steps": [r["step"] for r in timed],
    }


def compare(titan: dict, loop: dict | None) -> dict | None:
    """trainctl/torchtitan tokens/s from bench_loop's JSON, only where both ran the same shape."""
    if loop is None:
        return None
    # tokens per step are the recipe's even where torchtitan fell back to a smaller micro-batch (then noted)
    same = {key: loop.get(key) == titan.get(f"requested_{key}", titan[key])
            for key in ("recipe", "model", "batch", "precision", "compile")}
    same["fp8"] = not loop.get("fp8")
    if not all(same.values()):
        differ = sorted(k for k, ok in same.items() if not ok)
        return {"comparable": False, "differs_in": differ}
    ours = statistics.median(loop["trainctl_tokens_per_s"])
    return {"comparable": True, "trainctl_tokens_per_s": ours, "torchtitan_tokens_per_s": titan["tokens_per_s"],
            "ratio_trainctl_over_torchtitan": ours / titan["tokens_per_s"], "target": ">= 1.0",
            "note": titan.get("oom_fallback")}


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


OOM_MARKERS = ("torch.OutOfMemoryError", "CUDA out of memory")


def out_of_memory(lines: list[str]) -> bool:
    return any(marker in line for line in lines for marker in OOM_MARKERS)


def run_worker(spec: dict, toml_path: Path, timeout: float) -> tuple[list[str], int, list[str]]:
    """torchtitan under torchrun on one device, killed after `timeout` s; its output goes to our stdout."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
               str(WORKER), json.dumps(spec), "--job.config_file", str(toml_path)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LOG_RANK": "0"}
    lines, expired = [], threading.Event()

    def stop(proc):  # torchrun passes SIGTERM on to its worker (its own session); SIGKILL if it lingers
        expired.set()
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()

    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
        # A watchdog, not a check per line: a worker that hangs silently must not outlive the stage's limit.
        watchdog = threading.Timer(max(timeout, 1), stop, (proc,))
        watchdog.start()
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                lines.append(line)
            rc = proc.wait()
        finally:
            watchdog.cancel()
    if expired.is_set():
        lines.append(f"bench_titan: torchtitan ran past {timeout:.0f} s; stopped")
        print(lines[-1])
        rc = 124  # as timeout(1) reports it
    return command, rc, lines


def run(cfg, args, work: Path, spec: dict) -> dict:
    """torchtitan on the recipe's shape; where CUDA runs out of memory, once more at half the micro-batch with
    twice the accumulation (the same tokens per step, recorded as a fallback)."""
    t = cfg.train
    deadline, local, attempts = time.monotonic() + args.timeout, t.micro_batch, []
    while True:
        toml = to_toml(titan_job(cfg, args.device, args.warmup, args.steps, args.log_freq, work / "dump", local))
        (work / "titan.toml").write_text(toml)
        Path(spec["metrics_path"]).unlink(missing_ok=True)
        start = time.monotonic()
        command, rc, lines = run_worker(spec, work / "titan.toml", deadline - start)
        oom = out_of_memory(lines)
        attempts.append({"local_batch_size": local, "returncode": rc, "out_of_memory": oom,
                         "wall_s": round(time.monotonic() - start, 1)})
        if rc == 0 or not oom or args.device != "cuda" or local % 2 or len(attempts) > args.oom_retries \
                or deadline - time.monotonic() < 120:
            break
        print(f"bench_titan: torchtitan ran out of memory at local batch {local}; trying {local // 2}")
        local //= 2
    accum = t.micro_batch * t.grad_accum // local
    return {
        "recipe": cfg.recipe, "model": cfg.model.name, "device": args.device, "returncode": rc,
        "batch": f"{local}x{accum}x{t.seq_len}", "requested_batch": f"{t.micro_batch}x{t.grad_accum}x{t.seq_len}",
        "oom_fallback": None if len(attempts) == 1 or rc != 0 else (
            f"torchtitan ran out of memory at local batch {t.micro_batch}: ran {local} x {accum} accumulation, "
            "the same tokens per step"),
        "precision": cfg.precision.compute_dtype, "compile": t.compile,
        "activation_checkpointing": t.activation_checkpointing, "attempts": attempts,
        "warmup": args.warmup, "steps": args.steps, "log_freq": args.log_freq,
        "command": command, "config_toml": toml, "model_args": spec["model_args"],
        "tied_embeddings": TIED_NOTE if cfg.model.tie_embeddings else None,
        "log_tail": [line.rstrip() for line in lines[-20:]] if rc != 0 else None,
        "records": read_records(Path(spec["metrics_path"])), **versions(Path(spec["metrics_path"] + ".versions")),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="trainctl config overrides for the recipe (key=value)")
    parser.add_argument("--recipe", default="llama1b_bench")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--warmup", type=int, default=10, help="steps before the timed ones (compile, first peak)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--log-freq", type=int, default=5, help="torchtitan's metrics.log_freq (one interval each)")
    parser.add_argument("--json", type=Path, default=None, help="write titan.json here")
    parser.add_argument("--loop", type=Path, default=None, help="bench_loop's JSON, for trainctl/torchtitan")
    parser.add_argument("--timeout", type=float, default=480, help="seconds for all attempts together")
    parser.add_argument("--oom-retries", type=int, default=1, help="halvings of the micro-batch after a CUDA OOM")
    parser.add_argument("--dry-run", action="store_true", help="print the config and command; run nothing")
    parser.add_argument("--compare", type=Path, default=None, metavar="TITAN_JSON",
                        help="run nothing: compare this titan.json with --loop (results of separate device calls)")
    args = parser.parse_args(argv)
    if args.compare:
        return compare_files(args.compare, args.loop, args.json)
    if args.warmup % args.log_freq or args.steps % args.log_freq:
        parser.error("--warmup and --steps must be multiples of --log-freq (whole log intervals)")
    from trainctl.config.compose import compose  # launcher side: no torch
    from trainctl.config.errors import ConfigError

    with tempfile.TemporaryDirectory(prefix="bench-titan-") as tmp:
        work = Path(tmp)
        try:
            cfg = compose([f"recipe={args.recipe}", *args.overrides])
            job = titan_job(cfg, args.device, args.warmup, args.steps, args.log_freq, work / "dump")
            spec = {"device": args.device, "train_spec": TRAIN_SPEC, "flavor": FLAVOR,
                    "model_args": titan_model_args(cfg.model), "ffn_dim": cfg.model.ffn_dim,
                    "metrics_path": str(work / "metrics.jsonl")}
        except (ConfigError, ValueError) as err:
            raise SystemExit(f"bench_titan: {err}") from None
        print(f"bench_titan: torchtitan job config for {cfg.recipe} ({cfg.model.name}):\n{to_toml(job)}")
        print(f"bench_titan: worker spec {json.dumps(spec)}")
        if args.dry_run:
            return 0
        start = time.monotonic()
        result = run(cfg, args, work, spec)
        result["wall_s"] = round(time.monotonic() - start, 1)
    try:
        if result["returncode"] != 0:
            raise ValueError(f"torchtitan exited {result['returncode']}")
        result.update(summarize(result["records"], args.warmup))
        loop = json.loads(args.loop.read_text()) if args.loop and args.loop.exists() else None
        result["vs_trainctl"] = compare(result, loop)
    except (ValueError, KeyError) as err:
        result["error"] = str(err)
    report(result, args.json)
    return 1 if "error" in result else 0


def compare_files(titan_path: Path, loop_path: Path | None, json_path: Path | None) -> int:
    result = json.loads(titan_path.read_text())
    if "error" in result:
        raise SystemExit(f"bench_titan: {titan_path} records a failed run: {result['error']}")
    result["vs_trainctl"] = compare(result, json.loads(loop_path.read_text()) if loop_path else None)
    report(result, json_path)
    return 0


def versions(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def report(result: dict, json_path: Path | None) -> None:
    if json_path:
        json_path.write_text(json.dumps(result, indent=2) + "\n")
    if "error" in result:
        print(f"bench_titan: FAILED: {result['error']}")
        return
    print(f"torchtitan {result.get('torchtitan')} (torch {result.get('torch')}, {result.get('device_name')}): "
          f"{result['recipe']} shape, batch {result['batch']}, {result['precision']}, compile {result['compile']}: "
          f"{result['tokens_per_s']:.0f} tokens/s (median of {result['tokens_per_s_intervals']}), "
          f"MFU {result['mfu_pct']:.1f}% ({result['tflops']:.1f} TFLOPS; {result['flops_per_token']:.4g} FLOPs/token, "
          f"peak {result['peak_flops']:.3g}), peak active {result['peak_active_gib']} GiB")
    versus = result["vs_trainctl"]
    if versus is None:
        print("bench_titan: no loop.json: no trainctl/torchtitan ratio")
    elif not versus["comparable"]:
        print(f"bench_titan: loop.json ran another shape ({', '.join(versus['differs_in'])}): no ratio")
    else:
        print(f"ratio trainctl/torchtitan tokens/s: {versus['ratio_trainctl_over_torchtitan']:.3f} "
              f"({versus['trainctl_tokens_per_s']:.0f} / {versus['torchtitan_tokens_per_s']:.0f}; target >= 1.0)")


if __name__ == "__main__":
    sys.exit(main())
