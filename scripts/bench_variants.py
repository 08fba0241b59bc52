"""Throughput, MFU and peak memory of one recipe under several variants, through the real CLI.

Each variant is `trainctl launch RECIPE <base overrides> <variant overrides>`; the figures are
read back from the run's metrics.jsonl (train records after the first `--skip` logged steps,
which include compilation and warmup). Results go to a JSON file and a Markdown table.

The default variants are the single-GPU checks of the parallelism/precision issue on the ~1B
recipe: bf16 with compile off and on, activation checkpointing none / selective / full, and fp8.
Benchmarks run without evaluation (its first pass at step 0 would compile a second graph) and without W&B.
OUT.json and OUT.md are rewritten after every variant, so a call that runs out of time keeps what finished;
`--part I/N` runs the I-th of N contiguous slices of the variants, to split them across calls.

    python scripts/bench_variants.py --out benchmarks/llama1b_h100   # on a GPU machine
    python scripts/bench_variants.py --recipe tiny_cpu --base sharding=none cluster.procs_per_node=1 \\
        train.steps=6 schedule.warmup_steps=2 logging.log_every=2 --variants eager --out /tmp/bench  # CPU smoke
    python scripts/bench_variants.py --part 1/2 --out $OUT/variants-1of2 --runs-dir /tmp/runs  # first half
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import statistics
import subprocess
import sys
from pathlib import Path

# Named by what they change on top of the recipe (llama1b_bench: bf16, compile on, no AC).
VARIANTS = {
    "recipe": [],
    "compile": ["train.compile=true"],
    "eager": ["train.compile=false"],
    "ac_selective": ["train.activation_checkpointing=selective"],
    "ac_full": ["train.activation_checkpointing=full"],
    "ac_op": ["train.activation_checkpointing=op"],
    "fp8": ["precision=fp8"],
    "fp8_rowwise": ["precision=fp8", "precision.fp8_recipe=rowwise"],
}
GIB = 2**30
DEFAULT = ["eager", "compile", "ac_selective", "ac_full", "fp8", "fp8_rowwise"]
# Every variant: no evaluation (the step-0 eval compiles a second graph and is not what is measured), no
# checkpoints (five 1B variants would write ~69 GiB), no W&B (the GPU machine has neither wandb nor a network).
BENCH_OVERRIDES = ["train.eval_every=0", "checkpoint.save_final=false", "checkpoint.every=0",
                   "logging.wandb.mode=disabled"]


def run_variant(recipe: str, base: list[str], extra: list[str], runs_dir: Path, name: str) -> dict:
    """Launch one variant and summarize its train records (kept even when something after training failed).

    BENCH_OVERRIDES come last so that no base override turns evaluation or checkpoints back on. The run
    directory is the one this launch printed: the launcher suffixes `-1`, `-2` to a name that exists, and an
    older run's metrics must never be read in its place.
    """
    overrides = [*base, *extra, *BENCH_OVERRIDES]
    cmd = [sys.executable, "-m", "trainctl.cli", "launch", f"recipe={recipe}", f"runs_dir={runs_dir}",
           *overrides, "--name", name]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    result = {"variant": name, "overrides": overrides, "exit_code": proc.returncode}
    run_dir = launched_run_dir(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        result["error"] = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    if run_dir is None:
        result.setdefault("error", ["the launch printed no run directory"])
        return result
    result["run_dir"] = str(run_dir)
    metrics = run_dir / "metrics.jsonl"
    figures = summarize(metrics, model_figures(recipe, overrides)) if metrics.exists() else {}
    if "error" in figures and "error" in result:
        figures.pop("error")
    return {**result, **figures}


RUN_DIR_LINE = re.compile(r"^run directory: (.+)$", re.MULTILINE)


def launched_run_dir(output: str) -> Path | None:
    """The run directory `trainctl launch` printed (the last one, if it printed several)."""
    found = RUN_DIR_LINE.findall(output)
    return Path(found[-1].strip()) if found else None


def model_figures(recipe: str, overrides: list[str]) -> dict:
    """FLOPs per token of the variant's model and sequence length, under both attention conventions."""
    from trainctl.config.compose import compose
    from trainctl.plan.flops import flops_per_token

    cfg = compose([f"recipe={recipe}", *overrides])
    full = flops_per_token(cfg.model, cfg.train.seq_len)
    attention = 12.0 * cfg.model.n_layers * cfg.model.dim * cfg.train.seq_len
    return {"flops_per_token": full, "flops_per_token_causal": full - attention / 2}


def summarize(metrics: Path, model: dict | None = None, skip: int = 1) -> dict:
    """Medians of the train records after the first `skip` (compilation, warmup)."""
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [r for r in records if r.get("kind") == "train"][skip:]
    if not train:
        return {"error": ["no train records after warmup; raise train.steps"]}

    def median(key: str) -> float | None:
        values = [r[key] for r in train if key in r]
        return statistics.median(values) if values else None

    figures = {
        "tokens_per_s": median("tokens_per_s"),
        # The worker's MFU counts attention over the full sequence (PaLM's convention); the causal
        # convention halves the attention FLOPs (a causal kernel skips the masked half).
        "mfu": median("mfu"),
        "step_time_s": median("step_time_s"),
        "peak_mem_gib": max((r["peak_mem_gib"] for r in train if "peak_mem_gib" in r), default=None),
        "peak_reserved_gib": max((r["peak_reserved_gib"] for r in train if "peak_reserved_gib" in r), default=None),
        "final_loss": train[-1]["loss"],
    }
    if model and figures["mfu"] is not None:
        figures["mfu_causal"] = figures["mfu"] * model["flops_per_token_causal"] / model["flops_per_token"]
    return {**figures, **plan_against_measured(records)}


def plan_against_measured(records: list[dict]) -> dict:
    """The plan's peak next to the measured one (the worker's memory record: the busiest rank's peak step).

    On CUDA the measurement is torch.cuda.max_memory_allocated, the figure the issue's "within 10%" is about.
    """
    memory = [r for r in records if r.get("kind") == "memory"]
    if not memory:
        return {}
    measured, planned = memory[-1].get("peak_bytes"), (memory[-1].get("predicted") or {}).get("peak_bytes")
    if not measured or not planned:
        return {}
    return {"measured_peak_gib": measured / GIB, "plan_peak_gib": planned / GIB,
            "plan_peak_error": planned / measured - 1, "peak_source": memory[-1].get("peak_source")}


def plan_cell(r: dict) -> str:
    if "plan_peak_gib" not in r:
        return "-"
    return f"{r['plan_peak_gib']:.1f} ({r['plan_peak_error']:+.0%} vs {r['measured_peak_gib']:.1f})"


def markdown(results: list[dict], header: str) -> str:
    def cell(value, fmt):
        return "-" if value is None else format(value, fmt)

    columns = ("| variant | tokens/s | MFU (full attn) | MFU (causal attn) | step s | peak alloc GiB | "
               "peak reserved GiB | plan peak GiB (error) | loss | overrides |")
    lines = [header, "", columns, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "tokens_per_s" not in r:
            failed = " ".join(r["error"])
            lines.append(f"| {r['variant']} | failed: {failed} | | | | | | | | {' '.join(r['overrides'])} |")
            continue
        note = f" (then failed: {' '.join(r['error'])})" if "error" in r else ""
        lines.append(
            f"| {r['variant']}{note} | {cell(r['tokens_per_s'], ',.0f')} | {cell(r['mfu'], '.1%')} | "
            f"{cell(r.get('mfu_causal'), '.1%')} | {cell(r['step_time_s'], '.3f')} | "
            f"{cell(r['peak_mem_gib'], '.1f')} | {cell(r['peak_reserved_gib'], '.1f')} | {plan_cell(r)} | "
            f"{cell(r['final_loss'], '.3f')} | {' '.join(r['overrides'])} |"
        )
    return "\n".join(lines) + "\n"


def device_name() -> str:
    probe = ("import torch; "
             "print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu', torch.__version__)")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    return proc.stdout.strip() or platform.processor()


def part_of(names: list[str], part: str | None) -> list[str]:
    """The I-th of N contiguous, near-equal slices of `names` for `--part I/N` (all of them without it)."""
    if part is None:
        return names
    match = re.fullmatch(r"([1-9][0-9]*)/([1-9][0-9]*)", part)
    if not match or int(match[1]) > int(match[2]):
        raise SystemExit(f"bench_variants: --part {part}: expected I/N with 1 <= I <= N, e.g. --part 1/2")
    index, count = int(match[1]), int(match[2])
    size, extra = divmod(len(names), count)
    start = (index - 1) * size + min(index - 1, extra)
    return names[start:start + size + (index <= extra)]


def main(argv: list[str] | None = None) -> int:
    """Exit status 1 when a variant failed (its row says how), after every result is written."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="llama1b_bench")
    parser.add_argument("--base", nargs="*", default=[], help="overrides for every variant")
    parser.add_argument("--variants", nargs="*", default=DEFAULT, choices=sorted(VARIANTS))
    parser.add_argument("--part", default=None, metavar="I/N", help="only the I-th of N slices of the variants")
    parser.add_argument("--out", type=Path, required=True, help="output stem: writes OUT.json and OUT.md")
    parser.add_argument("--runs-dir", type=Path, default=None, help="run directories (default: OUT-runs beside OUT)")
    args = parser.parse_args(argv)

    names = part_of(args.variants, args.part)
    if not names:
        raise SystemExit(f"bench_variants: --part {args.part} of {len(args.variants)} variants selects none")
    runs_dir = args.runs_dir or args.out.parent / f"{args.out.name}-runs"
    meta = run_meta(args.recipe, "bench_variants.py", argv)
    results = []
    for index, name in enumerate(names):
        results.append(run_variant(args.recipe, args.base, VARIANTS[name], runs_dir, name))
        # After every variant: a call stopped at its time limit keeps the variants that finished.
        last = index == len(names) - 1
        write_results(args.out, args.recipe, "bench_variants.py", results, args.recipe, markdown, meta=meta,
                      quiet=not last)
        if not last:
            print(f"bench_variants: {name} done ({len(results)} of {len(names)}), written to {args.out}.json",
                  flush=True)
    failed = [r["variant"] for r in results if "error" in r]
    if failed:
        print(f"bench_variants: failed: {' '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def run_meta(recipe: str, script: str, argv: list[str] | None = None) -> dict:
    """Recipe, device, date and command of a benchmark (the device probe starts an interpreter: once per run)."""
    stamp = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    command = " ".join(["python", f"scripts/{script}", *(sys.argv[1:] if argv is None else argv)])
    return {"recipe": recipe, "device": device_name(), "date": stamp, "command": command}


def write_results(out: Path, recipe: str, script: str, results: list[dict], title: str, to_markdown,
                  meta: dict | None = None, quiet: bool = False) -> None:
    """OUT.json (device, date, command, results) and OUT.md (to_markdown's table under a header); prints the table."""
    meta = meta or run_meta(recipe, script)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({**meta, "results": results}, indent=2) + "\n")
    table = to_markdown(results, f"# {title} on {meta['device']}\n\n{meta['date']}\n\n`{meta['command']}`")
    out.with_suffix(".md").write_text(table)
    if not quiet:
        sys.stdout.write(table)


if __name__ == "__main__":
    sys.exit(main())
