"""Markdown tables from one folder of scripts/gpu_proof.sh results (stdlib only).

    python scripts/gpu_tables.py benchmarks/h200/2026-11-27            # prints the tables
    python scripts/gpu_tables.py benchmarks/h200/2026-11-27 --out benchmarks/h200/README.md

Reads what a GPU run left in $OUT: loop.json, titan.json, variants*.json, loss_head.json, proof.log. A file that is
missing leaves its table out; every table names the device, the date and the command that produced it.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

# The GPU commands of scripts/gpu_proof.sh's stages (bench_variants records its own command in its JSON).
COMMANDS = {
    "loop": "python scripts/bench_loop.py --recipe llama1b_bench --device cuda --warmup 10 --steps 30 --rounds 2",
    "titan": "python scripts/bench_titan.py --device cuda --warmup 10 --steps 30 --log-freq 5 --timeout 480",
    "loss_head": "python scripts/bench_loss_head.py --device cuda",
    "tests": "python -m pytest -m gpu -q -ra tests/gpu tests/dist/test_context_parallel.py",
}


def _load(folder: Path, name: str) -> dict | None:
    path = folder / name
    return json.loads(path.read_text()) if path.is_file() else None


def _variants(folder: Path) -> list[dict]:
    runs = []
    for path in sorted(folder.glob("variants*.json")):
        doc = json.loads(path.read_text())
        runs += [dict(r, command=doc["command"], date=doc["date"]) for r in doc["results"]]
    return runs


def _log_facts(folder: Path) -> dict:
    log = folder / "proof.log"
    text = log.read_text() if log.is_file() else ""
    facts = {"date": "", "torchao": "", "tests": "", "gpu": ""}
    if m := re.search(r"^=== \w+ \((\d{4}-\d\d-\d\d)T", text, re.M):
        facts["date"] = m.group(1)
    if m := re.search(r"torchao (\d[\w.+]*)", text):
        facts["torchao"] = m.group(1)
    if m := re.search(r"^device (NVIDIA[^(]+?) \(torch", text, re.M):
        facts["gpu"] = m.group(1)
    if m := re.search(r"^(\d+ (?:failed|passed).*) in [\d.]+s", text, re.M):
        facts["tests"] = m.group(1)
    return facts


def _n(x: float) -> str:
    return f"{x:,.0f}"


def _header(title: str, device: str, date: str, command: str) -> list[str]:
    return [f"## {title}", "", f"{device}, {date}. Command: `{command}`", ""]


def throughput_table(loop: dict | None, titan: dict | None, runs: list[dict], device: str, date: str) -> list[str]:
    """trainctl's loop, a bare loop, trainctl through its CLI and torchtitan: tokens/s, MFU, peak, ratios."""
    compiled = next((r for r in runs if r["variant"] == "compile"), None)
    if not (loop or titan or compiled):
        return []
    # FLOPs per token as trainctl counts them (6N + 12*L*d*s) and the bf16 peak, from a run that reports MFU.
    per_token = compiled["mfu"] / compiled["tokens_per_s"] if compiled else None
    rows = []

    def row(name: str, tps: float, peak: str) -> None:
        mfu = f"{100 * tps * per_token:.1f}%" if per_token else "-"
        rows.append(f"| {name} | {_n(tps)} | {mfu} | {peak} |")

    if loop:
        row("bare PyTorch loop (bench_loop, median of rounds)", statistics.median(loop["bare_tokens_per_s"]), "-")
        row("trainctl loop (bench_loop, median of rounds)", statistics.median(loop["trainctl_tokens_per_s"]), "-")
    if compiled:
        row("trainctl through its CLI (bench_variants `compile`)", compiled["tokens_per_s"],
            f"{compiled['measured_peak_gib']:.1f} allocated")
    if titan:
        row(f"torchtitan {titan['torchtitan']}, its own Trainer (bench_titan)", titan["tokens_per_s"],
            f"{titan['peak_active_gib']:.1f} active, {titan['peak_reserved_gib']:.1f} reserved")
    lines = _header("trainctl vs a bare loop vs torchtitan (Llama 3.2 1B shape, 8 x 2048, bf16, compile, no AC)",
                    device, date, f"{COMMANDS['loop']}; {COMMANDS['titan']}")
    lines += ["| | tokens/s | MFU (6N + 12·L·d·s, bf16 peak) | peak GiB |", "|---|---|---|---|", *rows, ""]
    ratios = []
    titan_tps = titan["tokens_per_s"] if titan else None
    if loop:
        ratios.append(f"trainctl/bare loop {loop['ratio_median']:.3f} (median)")
    if titan_tps and loop:
        ratios.append(f"trainctl loop/torchtitan {statistics.median(loop['trainctl_tokens_per_s']) / titan_tps:.3f}")
    if titan_tps and compiled:
        ratios.append(f"trainctl CLI/torchtitan {compiled['tokens_per_s'] / titan_tps:.3f} (target >= 1.05)")
        ratios.append(f"peak trainctl/torchtitan {compiled['measured_peak_gib'] / titan['peak_active_gib']:.2f}")
    if titan:
        lines += [f"torchtitan note: {titan.get('tied_embeddings') or 'same shape'}.", ""]
    return lines + (["Ratios: " + "; ".join(ratios) + ".", ""] if ratios else [])


def variants_table(runs: list[dict], device: str, date: str) -> list[str]:
    """Each variant through the CLI: tokens/s, MFU, measured and planned peak, and the fp8/bf16 ratio."""
    if not runs:
        return []
    base = next((r["tokens_per_s"] for r in runs if r["variant"] == "compile"), None)
    commands = sorted({r["command"] for r in runs})
    lines = _header("Variants through the CLI (llama1b_bench)", device, date, "`; `".join(commands))
    lines += ["| variant | tokens/s | vs compiled bf16 | MFU | peak allocated GiB | plan peak GiB | plan/measured |",
              "|---|---|---|---|---|---|---|"]
    for r in runs:
        vs = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        plan, measured = r["plan_peak_gib"], r["measured_peak_gib"]
        lines.append(f"| {r['variant']} | {_n(r['tokens_per_s'])} | {vs} | {100 * r['mfu']:.1f}% | {measured:.1f} | "
                     f"{plan:.1f} | {plan / measured:.3f} |")
    return lines + ["", "`vs compiled bf16` is the fp8/bf16 ratio for the fp8 rows (every variant but eager compiles; "
                    "target >= 1.2 for tensorwise at this shape); `plan/measured` is the plan's peak over "
                    "`torch.cuda.max_memory_allocated` (target within 5%).", ""]


def loss_head_table(head: dict | None, device: str, date: str) -> list[str]:
    """Chunked vs dense loss head per shape: times, peaks and their ratios."""
    if not head:
        return []
    lines = _header("Loss head: chunked vs dense (forward + backward, bf16)", device, date, COMMANDS["loss_head"])
    lines += ["| tokens x dim x vocab | chunk tokens | dense ms | chunked ms | time ratio | dense peak MiB | "
              "chunked peak MiB | peak ratio |", "|---|---|---|---|---|---|---|---|"]
    for s in head["sizes"]:
        lines.append(f"| {s['tokens']}x{s['dim']}x{s['vocab']} | {s.get('chunk_tokens', '-')} | "
                     f"{1e3 * s['dense_time_s']:.1f} | {1e3 * s['chunked_time_s']:.1f} | {s['ratio_time']:.2f} | "
                     f"{s['dense_peak_bytes'] / 2**20:.0f} | {s['chunked_peak_bytes'] / 2**20:.0f} | "
                     f"{s['ratio_peak']:.2f} |")
    lines.append("")
    for s in head["sizes"]:
        lines += _sweep(s)
    return lines


def _sweep(size: dict) -> list[str]:
    """One size's chunk sweep against the compiled dense head (bench_loss_head --chunks; absent before it)."""
    if not size.get("sweep") or not size.get("dense_compiled"):
        return []
    dense_s, dense_peak = size["dense_compiled_time_s"], size["dense_compiled_peak_bytes"]
    lines = [f"{size['tokens']}x{size['dim']}x{size['vocab']} against the compiled dense head "
             f"({1e3 * dense_s:.1f} ms, {dense_peak / 2**20:.0f} MiB; targets: time <= 1.05x, peak <= 0.5x):", "",
             "| chunk tokens | ms | time vs compiled dense | peak MiB | peak vs compiled dense |",
             "|---|---|---|---|---|"]
    for row in size["sweep"]:
        lines.append(f"| {row['chunk_tokens']} | {1e3 * row['time_s']:.1f} | {row['time_s'] / dense_s:.2f} | "
                     f"{row['peak_bytes'] / 2**20:.0f} | {row['peak_bytes'] / dense_peak:.2f} |")
    return lines + [""]


def render(folder: Path) -> str:
    loop, titan, head = _load(folder, "loop.json"), _load(folder, "titan.json"), _load(folder, "loss_head.json")
    runs, facts = _variants(folder), _log_facts(folder)
    gpu = facts["gpu"] or (loop or {}).get("device") or (titan or {}).get("device_name") or "unknown GPU"
    torch_version = (loop or titan or {}).get("torch", "")
    device = f"{gpu}, torch {torch_version}" + (f", torchao {facts['torchao']}" if facts["torchao"] else "")
    date = facts["date"] or (runs[0]["date"][:10] if runs else "undated")
    lines = [f"# {gpu}: measured figures", "",
             f"Rendered by `python scripts/gpu_tables.py {folder.as_posix()}` from the raw results in that folder.", ""]
    lines += throughput_table(loop, titan, runs, device, date)
    lines += variants_table(runs, device, date)
    lines += loss_head_table(head, device, date)
    if facts["tests"]:
        lines += _header("GPU test tier", device, date, COMMANDS["tests"]) + [f"Result: {facts['tests']}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--out", type=Path, help="write the tables here instead of printing them")
    args = parser.parse_args(argv)
    text = render(args.folder)
    if args.out:
        args.out.write_text(text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
