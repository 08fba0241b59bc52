"""scripts/hostile_probe.py on this checkout: its smoke test, one case of every area (15 of the 189 that start no
training), each of which must get the OK verdict.

The probe runs the real CLI in fresh folders with deadlines; a case that regresses to a traceback, a hang, a wrong
answer, an escape or a data loss fails with its id, verdict and what was seen. Every case is also a test of the tier
its feature lives in (tests/unit mostly), so the whole probe need not run here: `python scripts/hostile_probe.py`
(all of it, about 6 minutes on 2 cores) is what docs/contributing.md asks for before a change to the CLI's
commands is merged.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def test_one_case_of_every_area_is_ok(tmp_path):
    report = tmp_path / "verdicts.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "hostile_probe.py"), "--json", str(report),
                           "--markdown", str(tmp_path / "verdicts.md"), "--fast", "--per-area", "1"],
                          capture_output=True, text=True, timeout=900)
    assert report.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(report.read_text())["cases"]
    assert len(rows) >= 15 and len({r["area"] for r in rows}) == len(rows)  # every area, one case each
    bad = [f"{r['id']} {r['verdict']}: {r['area']}: {r['case']}: {r['detail']}" for r in rows if r["verdict"] != "OK"]
    assert not bad, "\n".join(bad)
    assert proc.returncode == 0 and (tmp_path / "verdicts.md").read_text().count("| OK |") == len(rows)
