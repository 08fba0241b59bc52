"""Checkpoint -> safetensors export: single file, shards, tied embeddings, checkpoint choice, user errors, the CLI."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from trainctl.config.schema import ModelConfig, RunConfig, to_yaml
from trainctl.models.export import main, parse_size, plan_shards
from trainctl.models.llama import build_model

STEP = "step-00000005"
# The fixture saves in one process without a process group, on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def make_run(root: Path, model_cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A run directory with one DCP checkpoint of a tiny model (plus optimizer state); returns the model's tensors."""
    torch.manual_seed(0)
    model = build_model(model_cfg, device="cpu")
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 8, dtype=torch.long)).float().pow(2).mean().backward()
    optimizer.step()
    root.mkdir(parents=True)
    (root / "config.yaml").write_text(to_yaml(RunConfig(model=model_cfg)))
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    dcp.save(state, checkpoint_id=str(root / "checkpoints" / STEP), no_dist=True)
    (root / "checkpoints" / STEP / "meta.json").write_text(json.dumps({"step": 5}))
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("saved")
    return root / "run", make_run(root / "run", ModelConfig())


@pytest.fixture
def run(saved, tmp_path):
    """A private copy of the saved run (exports write into it)."""
    template, tensors = saved
    shutil.copytree(template, tmp_path / "run")
    return tmp_path / "run", tensors


def assert_same_tensors(exported: dict[str, torch.Tensor], original: dict[str, torch.Tensor]) -> None:
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype, name
        assert torch.equal(exported[name], tensor), name


def test_single_file_export_equals_the_model_exactly(run):
    run_dir, original = run
    assert main([str(run_dir)]) == 0
    out = run_dir / "export" / STEP
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert_same_tensors(load_file(out / "model.safetensors"), original)
    config = json.loads((out / "config.json").read_text())
    assert config.pop("trainctl_checkpoint")["step"] == 5
    assert config == asdict(ModelConfig())
    assert not list((run_dir / "export").glob(".*tmp*")), "no temporary folder left behind"


def test_sharded_export_equals_the_model_and_indexes_every_tensor(run):
    run_dir, original = run
    limit = 2_000_000
    assert main([str(run_dir), "--out", str(run_dir / "sharded"), "--max-shard-size", str(limit)]) == 0
    out = run_dir / "sharded"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(p.name for p in out.glob("*.safetensors")) == files
    assert not (out / "model.safetensors").exists()
    exported = {}
    for name in files:
        shard = load_file(out / name)
        assert all(index["weight_map"][key] == name for key in shard)
        assert sum(t.numel() * t.element_size() for t in shard.values()) <= limit or len(shard) == 1
        exported.update(shard)
    assert_same_tensors(exported, original)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in original.values())


def test_tied_embeddings_are_saved_once(tmp_path):
    original = make_run(tmp_path / "run", ModelConfig(tie_embeddings=True))
    assert main([str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert "output.weight" not in exported
    assert_same_tensors(exported, {k: v for k, v in original.items() if k != "output.weight"})
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_embeddings"] is True


def test_default_is_the_newest_committed_checkpoint(run):
    run_dir, _ = run
    checkpoints = run_dir / "checkpoints"
    shutil.copytree(checkpoints / STEP, checkpoints / "step-00000003")
    shutil.copytree(checkpoints / STEP, checkpoints / "step-00000009.tmp")  # in flight: never counts
    (checkpoints / "step-00000007").mkdir()  # no DCP metadata: not a readable checkpoint
    assert main([str(run_dir)]) == 0
    assert sorted(p.name for p in (run_dir / "export").iterdir()) == [STEP]


def test_checkpoint_by_name_or_path(run):
    run_dir, original = run
    shutil.copytree(run_dir / "checkpoints" / STEP, run_dir / "checkpoints" / "step-00000003")
    assert main([str(run_dir), "--checkpoint", "step-00000003"]) == 0
    assert json.loads((run_dir / "export" / "step-00000003" / "config.json").read_text())["trainctl_checkpoint"]["step"] == 3
    assert main([str(run_dir), "--checkpoint", str(run_dir / "checkpoints" / STEP), "--out", str(run_dir / "by-path")]) == 0
    assert_same_tensors(load_file(run_dir / "by-path" / "model.safetensors"), original)


def user_error(args: list[str], capsys) -> str:
    assert main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_user_errors_exit_2_with_one_line(run, tmp_path, capsys):
    run_dir, _ = run
    assert "no such run directory" in user_error([str(tmp_path / "missing")], capsys)
    (tmp_path / "plain").mkdir()
    assert "not a run directory" in user_error([str(tmp_path / "plain")], capsys)
    assert "no such checkpoint" in user_error([str(run_dir), "--checkpoint", "step-00000099"], capsys)
    (run_dir / "checkpoints" / "step-00000006.tmp").mkdir()
    assert "uncommitted" in user_error([str(run_dir), "--checkpoint", "step-00000006.tmp"], capsys)
    assert "not a committed DCP checkpoint" in user_error([str(run_dir), "--checkpoint", str(run_dir)], capsys)
    assert "--max-shard-size=0" in user_error([str(run_dir), "--max-shard-size", "0"], capsys)
    (run_dir / "taken").mkdir()
    (run_dir / "taken" / "x").write_text("")
    assert "not empty" in user_error([str(run_dir), "--out", str(run_dir / "taken")], capsys)
    shutil.rmtree(run_dir / "checkpoints")
    assert "no committed checkpoint" in user_error([str(run_dir)], capsys)


def test_checkpoint_of_another_model_shape_is_refused(run, capsys):
    run_dir, _ = run
    (run_dir / "config.yaml").write_text(to_yaml(RunConfig(model=ModelConfig(n_layers=5, dim=128))))
    message = user_error([str(run_dir)], capsys)
    assert "does not match the run's model config" in message and "missing layers.4" in message


def test_bad_config_yaml_is_a_user_error(run, capsys):
    run_dir, _ = run
    (run_dir / "config.yaml").write_text("model:\n  dim: not-a-number\n")
    assert "cannot be read as a run config" in user_error([str(run_dir)], capsys)


@pytest.mark.parametrize("text, size", [("5000000000", 5 * 10**9), ("500MB", 5 * 10**8), ("2GiB", 2 * 2**30), ("7 kb", 7000)])
def test_parse_size(text, size):
    assert parse_size(text) == size


def test_plan_shards_keeps_order_and_gives_big_tensors_their_own_shard():
    sizes = {"a": 4, "b": 4, "c": 10, "d": 1, "e": 3}
    assert plan_shards(list(sizes), sizes, 8) == [["a", "b"], ["c"], ["d", "e"]]
    assert plan_shards(list(sizes), sizes, 100) == [list(sizes)]


# The CLI's real entry point in a fresh interpreter; reports whether the CLI process imported torch.
PROBE = """
import json, sys
from trainctl.cli import main
sys.argv = ["trainctl", *sys.argv[1:]]
code = 0
try:
    main()
except SystemExit as exc:
    code = exc.code or 0
print("__HEAVY__" + json.dumps(sorted(m for m in ("torch", "wandb") if m in sys.modules)), file=sys.stderr)
sys.exit(code)
"""


def trainctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=300)


def test_cli_export_runs_the_exporter_without_importing_torch(run):
    run_dir, original = run
    proc = trainctl("export", str(run_dir), "--max-shard-size", "3MB")
    assert proc.returncode == 0, proc.stderr
    assert '__HEAVY__[]' in proc.stderr
    out = run_dir / "export" / STEP
    index = json.loads((out / "model.safetensors.index.json").read_text())
    exported = {k: v for f in set(index["weight_map"].values()) for k, v in load_file(out / f).items()}
    assert_same_tensors(exported, original)


def test_cli_export_passes_user_errors_through(tmp_path):
    proc = trainctl("export", str(tmp_path))
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("__HEAVY__")]
    assert lines == [f"error: {tmp_path}: not a run directory (no config.yaml in it)"]
