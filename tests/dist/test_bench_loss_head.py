"""Smoke test of scripts/bench_loss_head.py: run as a user would, at its --quick size on CPU.

The figures are measurements and not asserted, except what the script itself promises: both `ratio` lines,
every figure in --json, and the chunked head's loss and gradients equal to the dense head's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import rounding_rel

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_loss_head.py"

pytestmark = pytest.mark.dist


def test_bench_loss_head_reports_time_and_peak_of_both_heads(tmp_path):
    out = tmp_path / "loss_head.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--chunks", "128", "all",
                           "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ratio time chunked/dense" in proc.stdout and "ratio peak chunked/dense" in proc.stdout
    assert "USDT" not in proc.stderr  # the profiler's C++ chatter is silenced
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["dtype"] == "float32"
    (size,) = result["sizes"]
    assert (size["tokens"], size["dim"], size["vocab"]) == (512, 128, 4096)
    assert size["chunk_tokens"] % 128 == 0 and size["compiled"] is False
    for arm in ("dense", "chunked"):
        assert size[f"{arm}_time_s"] > 0 and size[f"{arm}_peak_bytes"] > 0
    assert size["ratio_time"] > 0 and 0 < size["ratio_peak"] < 1  # 4 chunks: far below the dense logits
    # Relative to the dense maxima; the chain: the logits (dim), the softmax and the gradients' products (vocab
    # each), the loss's sum over tokens (tests.helpers.rounding_rel).
    terms = size["dim"] + 2 * size["vocab"] + size["tokens"]
    assert max(size["relative_error"].values()) <= rounding_rel(torch.float32, terms), size["relative_error"]
    # The trainer's chunk with no headroom (a quarter of the dense fp32 gradients: 256 of 512 tokens), then the sweep.
    assert size["chunk_tokens"] == 256
    assert [row["chunk_tokens"] for row in size["sweep"]] == [128, 256, 512]
    assert all(row["time_s"] > 0 and row["peak_bytes"] > 0 for row in size["sweep"])
    assert size["dense_compiled"] is False and "dense_compiled_time_s" not in size  # compiled dense: CUDA by default


def test_bench_loss_head_refuses_a_malformed_size():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--sizes", "4096x2048"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "error: --sizes: '4096x2048' is not TOKENSxDIMxVOCAB" in proc.stderr
