"""The README's fine-tuning block, run as written (issue 24): a Hugging Face folder in, chat data prepared with its
tokenizer and chat template, LoRA under FSDP2 on two processes, eval, generate, both exports loaded back in
transformers and peft. The block is read from README.md between its markers, so the README cannot drift from what
works; the assertions are the figures the README states.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, worker_env

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def readme_block() -> str:
    text = (REPO / "README.md").read_text()
    found = re.search(r"<!-- finetune:begin -->\n```bash\n(.*?)```\n<!-- finetune:end -->", text, flags=re.S)
    assert found, "README.md lost its finetune:begin/end block"
    return found.group(1)


def test_the_readmes_fine_tuning_block_runs_and_says_what_the_readme_says(tmp_path):
    pytest.importorskip("peft")
    (tmp_path / "block.sh").write_text(readme_block())
    # `.venv` active: its bin first on PATH, so `trainctl` and `python3` are this interpreter's.
    env = worker_env(PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
                     TRAINCTL_RUNS_DIR=str(tmp_path / "runs"), TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.run(["bash", "-euo", "pipefail", "block.sh"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout

    run = tmp_path / "runs" / "ft"
    result = json.loads((run / "result.json").read_text())
    assert result["steps"] == 80 and result["final_val_loss"] < 0.05 < 1 < result["initial_val_loss"], result
    # The plan's trainable count: rank x (in + out) per target per layer (q 128->256, k/v 128->128, o 256->128,
    # gate/up 128->352, down 352->128), 2 layers.
    per_layer = 16 * ((128 + 256) + 2 * (128 + 128) + (256 + 128) + 3 * (128 + 352))
    assert f"{2 * per_layer:,} trainable parameters" in out + proc.stderr
    meta = json.loads((tmp_path / "chat-tokens" / "meta.json").read_text())
    assert meta["content"] == "chat" and 0 < meta["splits"]["train"]["loss_tokens"] < meta["splits"]["train"]["tokens"] / 5

    evaluated = re.search(r"step 80: val loss ([0-9.]+), perplexity ([0-9.]+)", out)
    assert evaluated and float(evaluated.group(1)) < 0.05, out
    assert "\nYes.\n" in out  # trainctl generate --chat, stopped at <|im_end|>
    assert "verified: transformers loads it as Qwen3ForCausalLM" in out
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "ft_adapter").iterdir()}
    assert "Qwen3ForCausalLM 'Yes.'" in out and "PeftModelForCausalLM 'Yes.'" in out
