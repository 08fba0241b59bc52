"""scripts/gpu_tables.py: the committed GPU tables are what the committed raw results render to."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import gpu_tables  # noqa: E402

pytestmark = pytest.mark.unit

H200 = REPO / "benchmarks" / "h200"
RESULTS = H200 / "2026-11-27"


def test_the_committed_h200_tables_render_from_the_raw_results(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    out = tmp_path / "README.md"
    assert gpu_tables.main([str(RESULTS.relative_to(REPO)), "--out", str(out)]) == 0
    assert out.read_text() == (H200 / "README.md").read_text(), "rerun scripts/gpu_tables.py --out README.md"
    text = out.read_text()
    assert "NVIDIA H200, torch 2.11.0+cu130, torchao 0.18.0, 2026-11-27" in text
    # Every variant's tokens/s carries over, as the JSON has it.
    for path in RESULTS.glob("variants*.json"):
        for run in json.loads(path.read_text())["results"]:
            assert f"| {run['variant']} | {run['tokens_per_s']:,.0f} |" in text


def test_a_partial_results_folder_renders_what_it_has(tmp_path, capsys):
    shutil.copy(RESULTS / "loss_head.json", tmp_path)
    assert gpu_tables.main([str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "## Loss head" in text and "| 8192x4096x128256 | 1024 |" in text
    assert "## Variants" not in text and "torchtitan" not in text


def test_a_chunk_sweep_is_rendered_against_the_compiled_dense_head(tmp_path, capsys):
    size = {"tokens": 1024, "dim": 64, "vocab": 512, "chunk_tokens": 256, "dense_time_s": 0.004,
            "chunked_time_s": 0.003, "ratio_time": 0.75, "dense_peak_bytes": 4 * 2**20, "chunked_peak_bytes": 2**20,
            "ratio_peak": 0.25, "dense_compiled": True, "dense_compiled_time_s": 0.002,
            "dense_compiled_peak_bytes": 2 * 2**20,
            "sweep": [{"chunk_tokens": 256, "time_s": 0.003, "peak_bytes": 2**20},
                      {"chunk_tokens": 1024, "time_s": 0.0021, "peak_bytes": 3 * 2**20}]}
    (tmp_path / "loss_head.json").write_text(json.dumps({"device": "cuda", "sizes": [size]}))
    assert gpu_tables.main([str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "| 256 | 3.0 | 1.50 | 1 | 0.50 |" in text and "| 1024 | 2.1 | 1.05 | 3 | 1.50 |" in text
