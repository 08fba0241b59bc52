#!/usr/bin/env python3
"""Try trainctl as a hostile and a careless user would, and give each case a verdict (issue 21).

    python scripts/hostile_probe.py [--only TEXT] [--fast] [--per-area N] [--jobs N] [--trainctl DIR]
                                    [--json FILE] [--markdown FILE] [--before FILE]

Every case (scripts/hostile/*.py) runs the real CLI in a fresh folder with a deadline, the way a user types
it, and gets one verdict: OK, traceback, wrong, hang, escape (read or wrote outside what it may) or data loss.
`--trainctl DIR` tries another checkout (e.g. a `git worktree` of an older commit: its verdicts are the
"before" of a fix); `--before FILE` (an earlier --json) adds its verdicts as a column. Exit code: 0 when every
case is OK, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the cases: scripts/hostile/

from hostile import (  # noqa: E402,F401
    boundary,
    data,
    experts,
    hf,
    hf_data,
    integrity,
    moe,
    optim,
    preference,
    ramp,
    recipes,
    records,
    resume,
    sweeps,
)
from hostile.common import CASES, VERDICTS, Case, Probe, Verdict  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
AREA_IDS = {"api": "A", "edges": "E", "data": "D", "hf": "H", "records": "R", "recipes": "C", "resume": "M",
            "sweeps": "S", "launch": "L", "integrity": "I", "optim": "O", "moe": "X", "ep": "Q", "preference": "P",
            "ramp": "B"}


def case_ids(cases: list[Case]) -> dict[int, str]:
    """Stable ids by area and order of definition: D01, D02, ... (kept across runs for before/after tables)."""
    counts: dict[str, int] = {}
    ids = {}
    for c in cases:
        counts[c.area] = counts.get(c.area, 0) + 1
        ids[id(c)] = f"{AREA_IDS.get(c.area, c.area[:1].upper())}{counts[c.area]:02d}"
    return ids


def run_case(c: Case, trainctl: Path) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="hostile-"))
    started = time.monotonic()
    try:
        c.fn(Probe(tmp, str(trainctl)))
        verdict, detail = "OK", ""
    except Verdict as v:
        verdict, detail = v.kind, v.detail
    except Exception as exc:  # the harness itself: reported, never silently OK
        verdict, detail = "wrong", f"harness: {type(exc).__name__}: {exc}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"area": c.area, "case": c.name, "verdict": verdict, "detail": detail,
            "seconds": round(time.monotonic() - started, 1)}


def select(only: str | None, fast: bool, per_area: int | None = None) -> list[Case]:
    chosen = [c for c in CASES if not (fast and c.slow)]
    if only:
        ids = case_ids(CASES)
        chosen = [c for c in chosen if only.lower() in f"{ids[id(c)]} {c.area} {c.name}".lower()]
    if per_area:
        chosen = spread_over_areas(chosen, per_area)
    return chosen


def spread_over_areas(cases: list[Case], per_area: int) -> list[Case]:
    """`per_area` cases of each area, evenly spaced over its cases (its first and last among them): every area's
    machinery tried at once, the same cases every time."""
    by_area: dict[str, list[Case]] = {}
    for c in cases:
        by_area.setdefault(c.area, []).append(c)
    keep = set()
    for group in by_area.values():
        n = min(per_area, len(group))
        keep |= {id(group[round(i * (len(group) - 1) / max(n - 1, 1))]) for i in range(n)}
    return [c for c in cases if id(c) in keep]


def markdown(rows: list[dict], before: dict[str, str] | None) -> str:
    head = "| id | area | case | before | after | detail |" if before is not None else \
        "| id | area | case | verdict | detail |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = [r["id"], r["area"], r["case"]]
        if before is not None:
            cells.append(before.get(r["id"], "-"))
        cells += [r["verdict"], r["detail"].replace("|", "/")[:140]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def summary(rows: list[dict]) -> str:
    counts = {v: sum(r["verdict"] == v for r in rows) for v in VERDICTS}
    return ", ".join(f"{v} {n}" for v, n in counts.items() if n) + f" ({len(rows)} cases)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="cases whose id, area or name contains this text")
    ap.add_argument("--fast", action="store_true", help="skip the cases that start torch workers")
    ap.add_argument("--per-area", type=int, metavar="N",
                    help="only N cases of each area, spread over it (a quick check of every area; CI's smoke test)")
    ap.add_argument("--jobs", type=int, default=2, help="cases run at once (default 2)")
    ap.add_argument("--trainctl", type=Path, default=REPO, help="the checkout to try (default: this one)")
    ap.add_argument("--json", type=Path, help="write the verdicts as JSON")
    ap.add_argument("--markdown", type=Path, help="write the verdicts as a markdown table")
    ap.add_argument("--before", type=Path, help="an earlier --json: its verdicts become the table's before column")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    args = ap.parse_args(argv)
    cases, ids = select(args.only, args.fast, args.per_area), case_ids(CASES)
    if args.list:
        print("".join(f"{ids[id(c)]}\t{c.area}\t{c.name}\n" for c in cases), end="")
        return 0
    if not cases:
        print(f"no case matches {args.only!r}", file=sys.stderr)
        return 2
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = list(pool.map(lambda c: run_case(c, args.trainctl.resolve()), cases))
    rows = [{"id": ids[id(c)], **r} for c, r in zip(cases, results, strict=True)]
    for r in rows:
        print(f"{r['id']}\t{r['verdict']}\t{r['seconds']:5.1f}s\t{r['area']}: {r['case']}"
              + (f"\n\t\t{r['detail']}" if r["detail"] else ""))
    before = None
    if args.before:
        before = {r["id"]: r["verdict"] for r in json.loads(args.before.read_text())["cases"]}
    if args.json:
        args.json.write_text(json.dumps({"trainctl": str(args.trainctl), "cases": rows}, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(markdown(rows, before))
    print(summary(rows))
    return 0 if all(r["verdict"] == "OK" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
