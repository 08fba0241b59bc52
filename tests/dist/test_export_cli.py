"""`trainctl export` through the real console entry in a fresh interpreter: the verified choice end to end.

Slow for the unit tier (two interpreters importing torch), so it lives with the process-running tests.
"""

from __future__ import annotations

import json
import os

import pytest
from safetensors.torch import load_file

from tests.helpers import run_cli
from tests.unit.export_checkpoints import SHARD, SMALL, assert_same_tensors, flip_bytes, make_run

pytestmark = [pytest.mark.dist, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]



def trainctl(*args: str) -> tuple[int, list[str], str]:
    """(exit code, stderr lines without the probe's, the probe's report on whether the CLI process itself
    imported torch or wandb: the exporter is its child)."""
    proc = run_cli(*args, timeout=300)
    heavy = "__HEAVY__" + json.dumps(proc.probe["heavy"]) if proc.probe else "(no report: the CLI crashed)"
    return proc.returncode, proc.stderr.strip().splitlines(), heavy


def test_cli_export_takes_the_newest_valid_checkpoint_of_a_named_run_and_refuses_a_damaged_one(tmp_path):
    runs_dir = tmp_path / "runs"
    tensors = make_run(runs_dir / "r1", SMALL, steps=(3, 5))
    flip_bytes(runs_dir / "r1" / "checkpoints" / "step-00000005" / SHARD)
    sha_error = f"{SHARD}: content differs from the manifest (sha256)"

    code, err, heavy = trainctl("export", "r1", "--runs-dir", str(runs_dir), "--checkpoint", "step-00000005")
    assert code == 2 and heavy == "__HEAVY__[]"
    assert len(err) == 1, err
    assert err[0].startswith(f"error: --checkpoint step-00000005: fails verification: {sha_error}"), err
    assert not (runs_dir / "r1" / "export").exists()

    code, err, heavy = trainctl("export", "r1", "--runs-dir", str(runs_dir))
    assert code == 0 and heavy == "__HEAVY__[]", err
    assert err == [f"warning: skipped step-00000005: {sha_error}"]
    out = runs_dir / "r1" / "export" / "step-00000003"
    assert json.loads((out / "config.json").read_text())["trainctl_checkpoint"]["step"] == 3
    assert_same_tensors(load_file(out / "model.safetensors"), tensors[3], SMALL)


def test_cli_export_verify_passes_a_good_export_and_refuses_an_existing_folder_untouched(tmp_path):
    pytest.importorskip("transformers")
    runs_dir = tmp_path / "runs"
    make_run(runs_dir / "r1", SMALL)
    proc = run_cli("export", "r1", "--runs-dir", str(runs_dir), "--verify", timeout=300)
    assert proc.returncode == 0 and proc.probe["heavy"] == [], proc.stderr
    assert proc.stderr.strip() == "", proc.stderr  # torch's and torchao's import-time log lines are kept quiet
    assert "verified: transformers loads it as LlamaForCausalLM with no missing or unexpected keys" in proc.stdout
    out = runs_dir / "r1" / "export" / "step-00000005"
    before = sorted(p.name for p in out.iterdir())

    code, err, heavy = trainctl("export", "r1", "--runs-dir", str(runs_dir), "--verify")
    assert code == 2 and heavy == "__HEAVY__[]"
    assert err == [f"error: {out}: already exists and is not empty; remove it or pass --out DIR"]
    assert sorted(p.name for p in out.iterdir()) == before



@pytest.mark.parametrize("error", ["RuntimeError", "ImportError"])
def test_cli_export_verify_with_a_transformers_that_does_not_import_is_one_line(tmp_path, error):
    """A transformers that is found but fails to import (as one built for another torch) is named as such, in one
    line, with nothing written: not a traceback, and not "not installed"."""
    runs_dir = tmp_path / "runs"
    make_run(runs_dir / "r1", SMALL)
    fake = tmp_path / "site" / "transformers"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(f"raise {error}('built for another torch')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake.parent), os.environ.get("PYTHONPATH", "")])}
    proc = run_cli("export", "r1", "--runs-dir", str(runs_dir), "--verify", timeout=300, env=env)
    assert proc.returncode == 1 and proc.probe["heavy"] == [], proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: export --verify failed, nothing written: --verify: transformers does not import ({error}: built "
        "for another torch); repair it (pip install -U transformers) or export without --verify"]
    assert not (runs_dir / "r1" / "export").exists()
