"""Predicted vs measured per-rank peak memory across checkpointing modes and micro-batch sizes.

Each variant is `trainctl launch RECIPE <base> train.activation_checkpointing=MODE
train.micro_batch=MB train.grad_accum=-1 --force` (--force: a variant the plan says does not fit
is still measured; an out-of-memory crash is reported as such). The worker logs one step's peak
per rank in its `kind: memory` record (trainctl/train/observe/peak_memory.py: torch.cuda.max_memory_allocated
on CUDA, the CPU allocator's events on CPU) next to the plan's prediction for that rank, read from
the run's plan.json. The table shows the busiest rank of each run: predicted, measured, their ratio,
and the plan's verdict (which adds the framework allowance to the prediction).

train.compile is off by default: the plan follows eager ops (inductor's fused kernels save less);
pass `--base train.compile=true` to measure the compiled recipe as it is.

    python scripts/bench_memory.py --out benchmarks/llama1b_memory_h100          # on one GPU
    python scripts/bench_memory.py --recipe tiny_cpu --base cluster.procs_per_node=1 sharding=none \\
        train.seq_len=64 --modes none full --micro-batches 1 2 --out /tmp/bench_memory   # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from bench_variants import launched_run_dir, write_results  # same folder: the script's own directory is on sys.path

GIB = 2**30
MODES = ("none", "selective", "op", "full")
STEPS = 4  # the worker measures its third step


def run_variant(recipe: str, base: list[str], mode: str, micro_batch: int, runs_dir: Path) -> dict:
    """Launch one variant for a few steps and read its memory record back."""
    name = f"ac_{mode}-mb{micro_batch}"
    overrides = [f"train.activation_checkpointing={mode}", f"train.micro_batch={micro_batch}", "train.grad_accum=-1"]
    common = [f"recipe={recipe}", f"runs_dir={runs_dir}", f"train.steps={STEPS}", "schedule.warmup_steps=1",
              "train.eval_every=0", "logging.log_every=1", "checkpoint.save_final=false", *base]
    cmd = [sys.executable, "-m", "trainctl.cli", "launch", *common, *overrides, "--name", name, "--force"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    result = {"variant": name, "mode": mode, "micro_batch": micro_batch, "exit_code": proc.returncode}
    run_dir = launched_run_dir(proc.stdout + proc.stderr) or runs_dir / name  # the launcher may suffix the name
    result["run_dir"] = str(run_dir)
    plan = read_json(run_dir / "plan.json")
    if plan:
        memory = plan["memory"]
        result.update(predicted_peak_bytes=memory["peak_bytes"], verdict=memory["verdict"],
                      need_bytes=memory["need_bytes"], capacity_bytes=memory["capacity_bytes"],
                      peak_phase=memory["peak_phase"])
    record = memory_record(run_dir / "metrics.jsonl")
    if record is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        result["error"] = "out of memory" if "out of memory" in (proc.stderr + proc.stdout).lower() else tail[0][:200]
        return result
    busiest = max(record["per_rank"], key=lambda r: r["peak_bytes"])
    result.update(measured_peak_bytes=busiest["peak_bytes"],
                  predicted_rank_peak_bytes=busiest.get("predicted_peak_bytes"),
                  peak_source=busiest.get("peak_source"), **throughput(run_dir / "metrics.jsonl"))
    return result


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def memory_record(metrics: Path) -> dict | None:
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return None
    return next((r for r in map(json.loads, lines) if r.get("kind") == "memory"), None)


def throughput(metrics: Path) -> dict:
    """tokens/s and MFU of the last train record (after the measured step)."""
    train = [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("kind") == "train"]
    last = train[-1] if train else {}
    return {"tokens_per_s": last.get("tokens_per_s"), "mfu": last.get("mfu")}


def markdown(results: list[dict], header: str) -> str:
    def gib(value) -> str:
        if value is None:
            return "-"
        return f"{value / GIB:.2f} GiB" if value >= GIB else f"{value / 2**20:.1f} MiB"

    columns = ("| AC | micro-batch | predicted | measured | measured / predicted | plan verdict | peak phase "
               "| tokens/s |")
    lines = [header, "", columns, "|---|---|---|---|---|---|---|---|"]
    for r in results:
        predicted = r.get("predicted_rank_peak_bytes") or r.get("predicted_peak_bytes")
        measured = r.get("measured_peak_bytes")
        ratio = "-" if not (predicted and measured) else f"{measured / predicted:.3f}"
        outcome = r.get("error", ratio)
        tps = "-" if r.get("tokens_per_s") is None else f"{r['tokens_per_s']:,.0f}"
        lines.append(f"| {r['mode']} | {r['micro_batch']} | {gib(predicted)} | {gib(measured)} | {outcome} | "
                     f"{r.get('verdict', '-')} | {r.get('peak_phase', '-')} | {tps} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="llama1b_bench")
    parser.add_argument("--base", nargs="*", default=["train.compile=false"], help="overrides for every variant")
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    parser.add_argument("--micro-batches", nargs="*", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--out", type=Path, required=True, help="output stem: writes OUT.json and OUT.md")
    args = parser.parse_args()

    runs_dir = args.out.parent / f"{args.out.name}-runs"
    results = []
    for mode in args.modes:
        for micro_batch in args.micro_batches:
            result = run_variant(args.recipe, args.base, mode, micro_batch, runs_dir)
            results.append(result)
            print(json.dumps(result), flush=True)
    title = f"Peak memory per rank, predicted vs measured: {args.recipe}"
    write_results(args.out, args.recipe, "bench_memory.py", results, title, markdown)


if __name__ == "__main__":
    main()
