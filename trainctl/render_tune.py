"""`trainctl tune`'s table: the probed layouts, fastest measured first, predicted against measured."""

from __future__ import annotations

from rich.table import Table

MIB = 2**20


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.0%}"


def tune_table(data: dict) -> Table:
    """One row per probe (tune.json's rows): measured rank, the plan's rank, tokens/s and peak MiB with errors."""
    caption = (f"{len(data['rows'])} of {data['candidates']} fitting layouts probed for {data['probe_steps']} steps; "
               "pred: the plan's, meas: the probe's, err: meas/pred - 1")
    table = Table(title=f"tune {data['name']}: fastest measured first", title_justify="left", title_style="bold",
                  caption=caption, caption_justify="left", box=None, padding=(0, 1))
    table.add_column("#", justify="right")
    table.add_column("layout", overflow="fold", min_width=18)
    # Short headers: the table fits 80 columns (pred: the plan's, meas: the probe's).
    for column in ("plan#", "tok/s pred", "meas", "err", "MiB pred", "meas", "err"):
        table.add_column(column, justify="right", no_wrap=True)
    table.add_column("status", overflow="fold", min_width=6)
    for i, r in enumerate(data["rows"], start=1):
        peak = r["measured_peak_bytes"]
        table.add_row(
            str(i), r["label"], str(r["predicted_rank"]), _num(r["predicted_tokens_per_s"], ",.0f"),
            _num(r["measured_tokens_per_s"], ",.0f"), _pct(r["tokens_error"]),
            f"{r['predicted_peak_bytes'] / MIB:,.0f}", "-" if peak is None else f"{peak / MIB:,.0f}",
            _pct(r["peak_error"]), r["status"])
    return table
