"""Everything the CLI shows, rendered with rich: a run plan (`RunPlan.to_dict()`: run, dims, batch, memory per rank,
throughput, notes, advice), the plan comparison, and the values `trainctl.api` returns about runs (the runs table,
one run's status, a sweep's ranking). Tables go to a terminal as rich tables, to a pipe as tab-separated lines."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.markup import escape
from rich.table import Column, Table

GIB = 1024**3

# Rows of the memory table, in the order a step meets them: (key in the plan's memory dict, label).
MEMORY_ROWS = (
    ("params_bytes", "weights (fp32 master)"),
    ("reference_bytes", "frozen DPO reference (fp32)"),
    ("grads_bytes", "gradients (fp32)"),
    ("optimizer_bytes", "optimizer states"),
    ("ddp_buckets_bytes", "DDP gradient buckets"),
    ("gathered_loss_bytes", "FSDP gathered, at loss"),
    ("gathered_block_bytes", "FSDP gathered, block backward"),
    ("gathered_end_bytes", "FSDP gathered, end of backward"),
    ("unsharded_grads_bytes", "FSDP unsharded grads (accumulation)"),
    ("accumulated_grads_bytes", "gradients kept across micro-batches"),
    ("weight_casts_bytes", "autocast weight copies"),
    ("activations_per_micro_batch_bytes", "activations, one micro-batch"),
    ("activations_bytes", "activations, all in flight"),
    ("loss_buffers_bytes", "loss buffers (chunked, or fp32 tokens x vocab)"),
    ("recompute_bytes", "recomputed block"),
    ("grad_temp_bytes", "block backward temporaries"),
    ("step_temp_bytes", "optimizer step temporaries"),
    ("host_bytes", "in host memory (not on device)"),
)
FIT_ROWS = (
    ("peak_bytes", "peak (allocator)"),
    ("framework_bytes", "framework allowance"),
    ("need_bytes", "needed"),
    ("capacity_bytes", "device memory"),
    ("headroom_bytes", "headroom"),
)
VERDICT_STYLE = {"fits": "green", "tight": "yellow", "does not fit": "bold red", "unknown": "dim"}
MAX_RANK_COLUMNS = 8


def format_value(key: str, value) -> str:
    """Human units chosen by the key's suffix: bytes as GiB, FLOPs in scientific notation, counts with separators."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, (int, float)):
        if key.endswith("bytes"):
            return gib(value)
        if "flops" in key:
            return f"{value:.3e}"
        if isinstance(value, int):
            return f"{value:,}"
        return f"{value:,.4g}"
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value)
    return str(value)


def gib(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / GIB:,.2f} GiB" if abs(value) >= GIB else f"{value / 2**20:,.1f} MiB"


def _section(title: str, data: dict) -> Table:
    table = Table(title=title, title_justify="left", title_style="bold", show_header=False, box=None, padding=(0, 2))
    table.add_column("key", style="cyan")
    table.add_column("value", justify="right")
    for key, value in data.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={format_value(k, v)}" for k, v in value.items())
        table.add_row(key, format_value(key, value))
    return table


def memory_table(memory: dict) -> Table:
    """One column per pipeline rank (or one for all ranks): the breakdown, the phases, the verdict."""
    ranks = memory.get("per_pp_rank") or [memory]
    shown = ranks[:MAX_RANK_COLUMNS]
    table = Table(title="memory per rank", title_justify="left", title_style="bold", box=None, padding=(0, 2))
    table.add_column("", style="cyan")
    for r in shown:
        table.add_column(f"pp rank {r['pp_rank']}" if len(ranks) > 1 else "every rank", justify="right")
    for key, label in MEMORY_ROWS:
        if any(r.get(key) for r in shown):
            table.add_row(label, *(gib(r.get(key)) for r in shown))
    for phase in shown[0]["phases_bytes"]:
        table.add_row(f"at {phase.replace('_', ' ')}", *(gib(r["phases_bytes"][phase]) for r in shown), style="dim")
    for key, label in FIT_ROWS:
        table.add_row(label, *(gib(r.get(key)) for r in shown))
    table.add_row("verdict", *(f"[{VERDICT_STYLE[r['verdict']]}]{r['verdict']}[/]" for r in shown))
    return table


def ramp_table(stages: list[dict]) -> Table:
    """train.batch_ramp's stages: the steps of each batch size and the tokens they cover (the full batch last)."""
    table = Table(title="batch ramp (the lr schedule counts tokens)", title_justify="left", title_style="bold",
                  box=None, padding=(0, 2))
    for column in ("steps", "global batch", "grad_accum", "tokens"):
        table.add_column(column, justify="right")
    for s in stages:
        table.add_row(s["steps"], str(s["global_batch"]), str(s["grad_accum"]), f"{s['tokens']:,}")
    return table


def throughput_section(t: dict) -> Table:
    seconds = {k: v for k, v in (t.get("step_time") or {}).items() if k != "total_s" and v}
    data = {k: v for k, v in t.items() if k != "step_time"}
    if seconds:
        data["step_time_parts_s"] = ", ".join(f"{k[:-2]}={v:.3g}" for k, v in seconds.items())
    return _section("throughput", data)


def advice_table(advice: list[dict]) -> Table:
    table = Table(title="to make it fit (best "
                        "first)", title_justify="left", title_style="bold", box=None, padding=(0, 2))
    table.add_column("change", overflow="fold", ratio=1)
    for column in ("peak", "needed", "verdict", "step time"):
        table.add_column(column, justify="right", no_wrap=True)
    for a in advice:
        cost = "-" if a["slowdown"] is None else f"{a['slowdown']:+.0%}"
        table.add_row(" ".join(a["overrides"]), gib(a["peak_bytes"]), gib(a["need_bytes"]), a["verdict"], cost)
    return table


# Shown on their own after the tables (too long for a table cell), or not at all.
_OWN_LINE = ("launch_command",)
_HIDDEN = ("launch_argv",)
_SPECIAL = ("memory", "throughput", "notes", "advice", "warnings")


def render_plan(console: Console, plan: dict) -> None:
    """Scalars as the 'run' table, then one table per nested section, memory, throughput, notes, advice, warnings."""
    plan = {k: v for k, v in plan.items() if k not in _HIDDEN}
    own_line = {k: plan.pop(k) for k in _OWN_LINE if k in plan}
    special = {k: plan.pop(k) for k in _SPECIAL if k in plan}
    scalars = {k: v for k, v in plan.items() if not isinstance(v, (dict, list))}
    console.print(_section("run", scalars))
    for title, data in plan.items():
        if isinstance(data, dict):
            stages = data.get("ramp")
            console.print()
            console.print(_section(title, {k: v for k, v in data.items() if k != "ramp"}))
            if stages:
                console.print(ramp_table(stages))
    if "memory" in special:
        console.print()
        console.print(memory_table(special["memory"]))
    if "throughput" in special:
        console.print()
        console.print(throughput_section(special["throughput"]))
    for title, value in own_line.items():
        console.print()
        console.print(f"[bold]{title}[/]")
        console.print(value, soft_wrap=True, highlight=False, markup=False)
    if special.get("notes"):
        console.print()
        console.print("[bold]notes[/] (where the worker differs from the textbook)")
        for note in special["notes"]:
            console.print(f"- {note}", soft_wrap=True, highlight=False, markup=False)
    if special.get("advice"):
        console.print()
        console.print(advice_table(special["advice"]))
    for warning in special.get("warnings", []):
        console.print(f"[yellow]warning:[/] {warning}", soft_wrap=True, highlight=False)


def plan_summary(console: Console, plan: dict) -> None:
    """The launch's short plan: the model, the layout and batch, memory per rank with its verdict, the step time
    where one is estimated (a GPU); `trainctl plan` (or `launch --verbose`) shows every figure."""
    b, m = plan["batch"], plan["memory"]
    nodes = f"{plan['nodes']} nodes x {plan['procs_per_node']}" if plan["nodes"] > 1 else f"{plan['world_size']}"
    degrees = " x ".join(f"{k} {v}" for k, v in plan["dims"].items() if k in ("dp", "cp", "tp", "pp") and v > 1)
    if plan["dims"].get("ep", 1) > 1:  # a split of dp_shard, not another factor of the world
        degrees += f"; experts split over ep {plan['dims']['ep']}"
    params = plan["params_total"]
    count = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
    lines = [f"plan: {plan['model']}; {count} parameters",
             f"  {nodes} ranks on {plan['device']}, {plan['strategy']}" + (f" ({degrees})" if degrees else ""),
             f"  global batch {b['global_batch']} = {b['micro_batch']} micro x {b['grad_accum']} accum x "
             f"{b['dp']} dp, {b['seq_len']} tokens each ({b['tokens_per_step']:,} tokens per step)",
             *ramp_lines(b),
             f"  memory per rank: peak {gib(m['peak_bytes'])}, needs {gib(m['need_bytes'])} of "
             f"{gib(m['capacity_bytes'])}: {m['verdict']}"]
    if plan.get("step_time_s"):
        lines.append(f"  about {plan['step_time_s']:.3g} s per step (assumed MFU {plan['assumed_mfu']:.0%})")
    lines.append("  (the whole plan: `trainctl plan` with the same overrides, or launch --verbose)")
    for line in lines:
        console.print(line, highlight=False, markup=False, soft_wrap=True)


def ramp_lines(b: dict) -> list[str]:
    """The launch summary's lines for train.batch_ramp: its stages, at most a few (`trainctl plan` lists all)."""
    stages = b.get("ramp") or []
    if not stages:
        return []
    shown = stages if len(stages) <= 6 else [*stages[:3], None, *stages[-2:]]
    lines = [f"  batch ramp over {len(stages) - 1} stages, {b['tokens_total']:,} tokens in all "
             "(the lr schedule counts tokens):"]
    lines += ["    ..." if s is None else f"    steps {s['steps']}: global batch {s['global_batch']} "
              f"({s['grad_accum']} accum), {s['tokens']:,} tokens" for s in shown]
    return lines


def compare_table(axis: str, rows: list[dict]) -> Table:
    """`plan --compare AXIS`: one row per variant with its busiest rank's memory (GiB) and step time."""
    title = f"compare {axis}: your model and cluster, the busiest rank, memory in GiB"
    table = Table(title=title, title_justify="left", title_style="bold", box=None, padding=(0, 1))
    table.add_column("variant", overflow="fold")
    # Along optim the optimizer's own states are what changes: their column comes first.
    keys = (("optimizer_bytes",) if axis == "optim" else ()) + ("activations_bytes", "peak_bytes", "need_bytes")
    for column in (("optim.",) if axis == "optim" else ()) + ("activ.", "peak", "needed", "headroom", "verdict",
                                                               "step s", "vs now"):
        table.add_column(column, justify="right", no_wrap=True, min_width=12 if column == "verdict" else None)
    for r in rows:
        step = "-" if r["step_time_s"] is None else f"{r['step_time_s']:.3g}"
        change = "-" if r["slowdown"] is None else f"{r['slowdown']:+.0%}"
        headroom = "-" if r["headroom_bytes"] is None else f"{r['headroom_bytes'] / GIB:.1f}"
        style = VERDICT_STYLE[r["verdict"]]
        sizes = (f"{r[key] / GIB:.1f}" for key in keys)
        table.add_row(r["variant"], *sizes, headroom, f"[{style}]{r['verdict']}[/]", step, change)
    return table


# ---------------------------------------------------------------- runs, status, sweeps (values from trainctl.api)


def finite_json(value):
    """Strict JSON for scripts: NaN and infinities (a diverged loss) become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_json(v) for v in value]
    return value


def print_json(value) -> None:
    sys.stdout.write(json.dumps(finite_json(value), indent=2) + "\n")


def plain_table(header: tuple[str, ...], rows) -> Table:
    """A borderless table with a bold header; the cells are user text (shown as written, no markup)."""
    table = Table(*header, box=None, header_style="bold")
    for row in rows:
        table.add_row(*map(escape, row))
    return table


def table_or_lines(console: Console, header: list[str] | None, rows: list[list[str]], *columns: Column) -> None:
    """A rich table on a terminal; for grep, cut and awk: whole values, tab-separated, never cut."""
    if not console.is_terminal:
        sys.stdout.write("".join("\t".join(row) + "\n" for row in ([header] if header else []) + rows))
        return
    console.print(plain_table(columns or tuple(header or ()), rows))


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _step(state) -> str:
    if state.step is None:
        return "-"
    return f"{state.step}/{state.steps}" if state.steps else str(state.step)


RUN_COLUMNS = ("run", "launcher", "job", "state", "step", "loss", "eval", "tok/s")


def runs_table(console: Console, infos: list) -> None:
    """`trainctl runs`: one row per run (api.RunInfo); measured figures next to the plan's once some run has them:
    "38.2% (plan 40%)", "61.2 GiB (plan 60.3)"."""
    shown = any(i.figures.mfu is not None or i.figures.peak_bytes is not None for i in infos)
    tasks = any(i.figures.tasks for i in infos)
    rows = []
    for i in infos:
        st, f = i.state, i.figures
        rows.append([st.name, st.launcher or "-", st.job_id or "-", st.state, _step(st), _fmt(f.loss, ".4g"),
                     _fmt(f.val_loss, ".4g"), _fmt(f.tokens_per_s, ".0f"),
                     *((f.mfu_text(), f.peak_text()) if shown else ()), *((f.tasks_text() or "-",) if tasks else ()),
                     st.detail])
    header = [*RUN_COLUMNS, *(("mfu", "peak") if shown else ()), *(("lm-eval",) if tasks else ()), "detail"]
    table_or_lines(console, header, rows, *(Column(h, no_wrap=h != "detail") for h in header))


def sweep_table(console: Console, ranking) -> None:
    """`trainctl runs --sweep NAME` (api.SweepRanking): finished points ranked, unfinished ones last, marked."""
    header = ["rank", "run", "state", "train loss", "eval loss", "swept"]
    cells = [[str(i + 1) if r["finished"] else "-", r["run"], r["state"] + ("" if r["finished"] else " (unfinished)"),
              _fmt(r["train_loss"], ".4f"), _fmt(r["val_loss"], ".4f"), " ".join(r["swept"])]
             for i, r in enumerate(ranking.rows)]
    if console.is_terminal:
        ranked_by = "eval loss" if ranking.metric == "val_loss" else "train loss"
        console.print(f"sweep {ranking.name}: ranked by final {ranked_by}; unfinished points last", markup=False,
                      highlight=False)
    table_or_lines(console, header, cells)


def duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def status_panel(console: Console, info) -> None:
    """`trainctl status RUN` (api.RunInfo): one `key value` line for each thing known."""
    from trainctl.runs.figures import sparkline

    st, f = info.state, info.figures
    peak = f.peak_text() + (f", by {f.peak_source}" if f.peak_source else "")
    rows = [("run", str(st.path)), ("launcher", st.launcher or "- (not launched)"), ("job", st.job_id),
            ("state", st.state), ("detail", st.detail), ("step", _step(st)),
            ("loss", f"{_fmt(f.loss, '.4f')}  {sparkline(f.losses)}".strip() if f.loss is not None else ""),
            ("eval", _fmt(f.val_loss, ".4f") if f.val_loss is not None else ""),
            ("pairs", f.preference_text()), ("experts", f.experts_text()),
            ("speed", f"{f.tokens_per_s:,.0f} tokens/s" if f.tokens_per_s is not None else ""),
            ("eta", duration(info.eta_s) if info.eta_s is not None else ""),
            ("mfu", f.mfu_text()), ("peak", peak), ("lm-eval", f.tasks_text()), ("log", str(info.log))]
    for key, value in rows:
        if value:
            console.print(f"{key:9}{value}", highlight=False, soft_wrap=True, markup=False)


@contextmanager
def progress_bar(console: Console, description: str) -> Iterator[Callable[[int, int | None], None]]:
    """A transient byte-progress bar on a terminal (nothing elsewhere); yields `update(done, total)`."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    columns = ("[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task(description, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


# ---------------------------------------------------------------- trainctl tune (values from api.tuning)

MIB = 2**20


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.0%}"


def tune_table(data: dict) -> Table:
    """One row per probe (tune.json's rows): measured rank, the plan's rank, tokens/s and peak MiB with errors."""
    repeats = data.get("repeats", 1)
    times = f", {repeats} times each" if repeats > 1 else ""
    caption = (f"{len(data['rows'])} of {data['candidates']} fitting layouts probed for {data['probe_steps']} steps"
               f"{times}\npred: the plan's, meas: the probe's (the median of its repeats), spr: (slowest - fastest) "
               "/ median, err: meas/pred - 1")
    table = Table(title=f"tune {data['name']}: fastest measured first", title_justify="left", title_style="bold",
                  caption=caption, caption_justify="left", box=None, padding=(0, 1), collapse_padding=True)
    table.add_column("#", justify="right")
    table.add_column("layout", overflow="fold", min_width=16)
    # Short headers: the table fits 80 columns (pred: the plan's, meas: the probe's).
    for column in ("plan#", "tok/s pred", "meas", "spr", "err", "MiB pred", "meas", "err"):
        table.add_column(column, justify="right", no_wrap=True)
    table.add_column("status", overflow="fold", min_width=6)
    for i, r in enumerate(data["rows"], start=1):
        peak = r["measured_peak_bytes"]
        table.add_row(
            str(i), r["label"], str(r["predicted_rank"]), _num(r["predicted_tokens_per_s"], ",.0f"),
            _num(r["measured_tokens_per_s"], ",.0f"), _num(r.get("spread"), ".0%"), _pct(r["tokens_error"]),
            f"{r['predicted_peak_bytes'] / MIB:,.0f}", "-" if peak is None else f"{peak / MIB:,.0f}",
            _pct(r["peak_error"]), r["status"])
    return table
