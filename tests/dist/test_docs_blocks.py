"""Every command block of README.md and docs/*.md runs as written, so a page cannot rot (issue 32).

Each page runs in a fresh folder, its `bash` blocks in order (a later block may use what an earlier one made), each
under `bash -euo pipefail` with the checkout's trainctl and python first on PATH and no runs folder or config path
from outside. A failure names the page, the block's line and its output. `bash skip-ci: REASON` blocks are counted,
not run (tests/unit/test_docs_pages.py checks their reasons). Pages may add checks of what their blocks claim below.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.doc_blocks import blocks, pages
from tests.helpers import worker_env

pytestmark = [pytest.mark.dist, pytest.mark.slow]

BLOCK_TIMEOUT_S = 600


def _env(folder: Path) -> dict[str, str]:
    env = worker_env(PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
                     TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1", HOME=os.environ.get("HOME", str(folder)))
    for leaked in ("TRAINCTL_RUNS_DIR", "TRAINCTL_CONFIG_PATH"):
        env.pop(leaked, None)
    return env


def run_page(page: Path, folder: Path) -> str:
    """Run the page's runnable blocks in order in `folder`; their stdout and stderr together."""
    outputs = []
    for block in blocks(page):
        if block.skip_reason is not None:
            continue
        script = folder / f".block-{block.number}.sh"
        script.write_text(block.code)
        started = time.monotonic()
        proc = subprocess.run(["bash", "-euo", "pipefail", script.name], cwd=folder, env=_env(folder),
                              capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, (
            f"{block.where()} exited {proc.returncode} after {time.monotonic() - started:.0f} s:\n"
            f"{block.code}\n--- output (tail) ---\n{out[-4000:]}")
        outputs.append(proc.stdout)
        outputs.append(proc.stderr)
    return "\n".join(outputs)


RUNNABLE = [p for p in pages() if any(b.skip_reason is None for b in blocks(p))]


@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: p.name)
def test_the_pages_blocks_run_as_written(page, tmp_path):
    out = run_page(page, tmp_path)
    check = CHECKS.get(page.name)
    if check is not None:
        check(tmp_path, out)


def check_fine_tuning(folder: Path, out: str) -> None:
    """What docs/fine-tuning.md says its end-to-end block shows (the figures the page states)."""
    pytest.importorskip("peft")
    result = json.loads((folder / "runs" / "ft" / "result.json").read_text())
    assert result["steps"] == 80 and result["final_val_loss"] < 0.05 < 1 < result["initial_val_loss"], result
    # The plan's trainable count: rank x (in + out) per target per layer (q 128->256, k/v 128->128, o 256->128,
    # gate/up 128->352, down 352->128), 2 layers.
    per_layer = 16 * ((128 + 256) + 2 * (128 + 128) + (256 + 128) + 3 * (128 + 352))
    assert f"{2 * per_layer:,} trainable parameters" in out
    meta = json.loads((folder / "chat-tokens" / "meta.json").read_text())
    assert meta["content"] == "chat" and 0 < meta["splits"]["train"]["loss_tokens"] < meta["splits"]["train"]["tokens"] / 5
    evaluated = re.search(r"step 80: val loss ([0-9.]+), perplexity ([0-9.]+)", out)
    assert evaluated and float(evaluated.group(1)) < 0.05, out[-3000:]
    assert "\nYes.\n" in out  # trainctl generate --chat, stopped at <|im_end|>
    assert "verified: transformers loads it as Qwen3ForCausalLM" in out
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (folder / "ft_adapter").iterdir()}
    assert "Qwen3ForCausalLM 'Yes.'" in out and "PeftModelForCausalLM 'Yes.'" in out


def check_preference_tuning(folder: Path, out: str) -> None:
    """What docs/preference-tuning.md says its DPO run shows: the loss starts at ln 2 (the policy is the reference)
    and the chosen answers win on (nearly) every pair by the end; status shows the pair metrics."""
    metrics = [json.loads(line) for line in (folder / "runs" / "dpo" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in metrics if r["kind"] == "eval"]
    trains = [r for r in metrics if r["kind"] == "train"]
    import math

    import torch

    from tests.helpers import rounding_rel

    # every h is 0 at step 0: a log-sigmoid and a mean in fp32 away from ln 2
    assert evals[0]["step"] == 0 and abs(evals[0]["val_loss"] - math.log(2)) <= rounding_rel(torch.float32, 4), evals
    assert evals[-1]["val_loss"] < 0.3 and trains[-1]["reward_accuracy"] > 0.95, (evals, trains[-1])
    assert evals[-1]["reward_accuracy"] > 0.5 and evals[-1]["reward_margin"] > 0, evals  # held-out pairs
    assert re.search(r"pairs +accuracy [0-9.]+%, margin", out), out[-2000:]
    assert "cuts the answers" not in out, out[-2000:]
    assert re.search(r"step 20: val pairs \d+ .* dpo loss [0-9.]+, accuracy [0-9.]+%", out), out[-2000:]
    assert (folder / "runs" / "dpo" / "plot.png").is_file()  # the page's train.seq_len holds every pair whole
    assert json.loads((folder / "runs" / "simpo" / "result.json").read_text())["steps"] == 10


def check_tune(folder: Path, out: str) -> None:
    """What docs/tune.md's tune prints: the measured table, fastest first, and the launch line of the pinned winner,
    which the page's plan then reads."""
    assert "fastest measured first" in out and "launch it with: trainctl launch recipe=" in out, out[-3000:]
    assert (folder / "runs" / "tune" / "t" / "tiny_cpu_tuned.yaml").is_file()


CHECKS = {"fine-tuning.md": check_fine_tuning, "preference-tuning.md": check_preference_tuning, "tune.md": check_tune}
