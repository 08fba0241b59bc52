"""Rich rendering of a run plan: one table per section of `RunPlan.to_dict()`."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

GIB = 1024**3


def format_value(key: str, value) -> str:
    """Human units chosen by the key's suffix: bytes as GiB, FLOPs in scientific notation, counts with separators."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, (int, float)):
        if key.endswith("bytes"):
            return f"{value / GIB:,.2f} GiB" if value >= GIB else f"{value / 2**20:,.1f} MiB"
        if "flops" in key:
            return f"{value:.3e}"
        if isinstance(value, int):
            return f"{value:,}"
        return f"{value:,.4g}"
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value)
    return str(value)


def _section(title: str, data: dict) -> Table:
    table = Table(title=title, title_justify="left", title_style="bold", show_header=False, box=None, padding=(0, 2))
    table.add_column("key", style="cyan")
    table.add_column("value", justify="right")
    for key, value in data.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={format_value(k, v)}" for k, v in value.items())
        table.add_row(key, format_value(key, value))
    return table


# Shown on their own after the tables (too long for a table cell), or not at all.
_OWN_LINE = ("launch_command",)
_HIDDEN = ("launch_argv",)


def render_plan(console: Console, plan: dict) -> None:
    """Scalars first as the 'run' table, then one table per nested section, then the launch command and warnings."""
    plan = {k: v for k, v in plan.items() if k not in _HIDDEN}
    own_line = {k: plan.pop(k) for k in _OWN_LINE if k in plan}
    scalars = {k: v for k, v in plan.items() if not isinstance(v, (dict, list))}
    sections = {k: v for k, v in plan.items() if isinstance(v, dict)}
    lists = {k: v for k, v in plan.items() if isinstance(v, list)}
    if scalars:
        console.print(_section("run", scalars))
    for title, data in sections.items():
        console.print()
        console.print(_section(title, data))
    for title, value in own_line.items():
        console.print()
        console.print(f"[bold]{title}[/]")
        console.print(value, soft_wrap=True, highlight=False, markup=False)
    for title, items in lists.items():
        if title == "warnings":
            for warning in items:
                console.print(f"[yellow]warning:[/] {warning}")
        elif items:
            console.print()
            console.print(f"[bold]{title}[/]: {format_value(title, items)}", soft_wrap=True)
