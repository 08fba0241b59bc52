"""Checkpoint -> safetensors export: single file, shards, tied embeddings, verified checkpoint choice, user errors.

Real DCP checkpoints with real manifests (export_checkpoints.py). Damaged checkpoints and unwritable outputs are
in test_export_damaged.py; the CLI in a subprocess is in tests/dist/test_export_cli.py.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, replace

import pytest
from safetensors.torch import load_file

from tests.unit.export_checkpoints import SMALL, assert_same_tensors, main, make_run
from trainctl.config.load import to_yaml
from trainctl.config.schema import ModelConfig, RunConfig
from trainctl.core.checkpoints import MANIFEST
from trainctl.models.hf_folder import plan_shards

STEP = "step-00000005"
# The fixture saves in one process without a process group, on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("saved")
    return root / "run", make_run(root / "run", ModelConfig())[5]


@pytest.fixture
def run(saved, tmp_path):
    """A private copy of the saved run (exports write into it)."""
    template, tensors = saved
    shutil.copytree(template, tmp_path / "run")
    return tmp_path / "run", tensors


def test_single_file_export_equals_the_model_exactly(run):
    run_dir, original = run
    assert main([str(run_dir)]) == 0
    out = run_dir / "export" / STEP
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert_same_tensors(load_file(out / "model.safetensors"), original)
    config = json.loads((out / "config.json").read_text())
    assert config.pop("trainctl_checkpoint")["step"] == 5
    assert config.pop("trainctl_model") == asdict(ModelConfig())
    assert config["model_type"] == "llama" and config["torch_dtype"] == "float32"
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
    original = make_run(tmp_path / "run", replace(SMALL, tie_embeddings=True))[5]
    assert main([str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert "lm_head.weight" not in exported
    assert_same_tensors(exported, {k: v for k, v in original.items() if k != "output.weight"}, SMALL)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is True


def test_default_is_the_newest_committed_checkpoint(run):
    run_dir, _ = run
    checkpoints = run_dir / "checkpoints"
    shutil.copytree(checkpoints / STEP, checkpoints / "step-00000003")
    shutil.copytree(checkpoints / STEP, checkpoints / "step-00000009.tmp")  # in flight: never counts
    (checkpoints / "step-00000007").mkdir()  # no manifest: not committed
    shutil.copytree(checkpoints / STEP, checkpoints / "step-00000008")
    (checkpoints / "step-00000008" / MANIFEST).unlink()  # a save that died before its commit
    assert main([str(run_dir)]) == 0
    assert sorted(p.name for p in (run_dir / "export").iterdir()) == [STEP]


def test_checkpoint_by_name_or_path(run):
    run_dir, original = run
    shutil.copytree(run_dir / "checkpoints" / STEP, run_dir / "checkpoints" / "step-00000003")
    assert main([str(run_dir), "--checkpoint", "step-00000003"]) == 0
    exported = json.loads((run_dir / "export" / "step-00000003" / "config.json").read_text())
    assert exported["trainctl_checkpoint"]["step"] == 3
    by_path = ["--checkpoint", str(run_dir / "checkpoints" / STEP), "--out", str(run_dir / "by-path")]
    assert main([str(run_dir), *by_path]) == 0
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
    assert "not a committed checkpoint" in user_error([str(run_dir), "--checkpoint", str(run_dir)], capsys)
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


def test_a_config_edited_after_training_or_another_runs_checkpoint_is_refused(run, tmp_path, capsys):
    run_dir, _ = run
    edited = (run_dir / "config.yaml").read_text().replace("rope_theta: 10000.0", "rope_theta: 500000.0")
    assert "500000.0" in edited
    (run_dir / "config.yaml").write_text(edited)
    message = user_error([str(run_dir), "--out", str(tmp_path / "out")], capsys)
    assert "saved from another model" in message and "model.rope_theta=500000.0 (saved: 10000.0)" in message
    assert not (tmp_path / "out").exists()
    # another run's checkpoint, of the same shapes, under this run's config: its norm_eps is not this model's
    make_run(tmp_path / "other", replace(ModelConfig(), rope_theta=500000.0, norm_eps=1e-6))
    other = tmp_path / "other" / "checkpoints" / STEP
    message = user_error([str(run_dir), "--checkpoint", str(other), "--out", str(tmp_path / "out")], capsys)
    assert "model.norm_eps=1e-05 (saved: 1e-06)" in message and "rope_theta" not in message
    assert main([str(tmp_path / "other"), "--out", str(tmp_path / "out")]) == 0  # under its own config: fine


def test_bad_config_yaml_is_a_user_error(run, capsys):
    run_dir, _ = run
    (run_dir / "config.yaml").write_text("model:\n  dim: not-a-number\n")
    assert "cannot be read as a run config" in user_error([str(run_dir)], capsys)


def test_plan_shards_keeps_order_and_gives_big_tensors_their_own_shard():
    sizes = {"a": 4, "b": 4, "c": 10, "d": 1, "e": 3}
    assert plan_shards(list(sizes), sizes, 8) == [["a", "b"], ["c"], ["d", "e"]]
    assert plan_shards(list(sizes), sizes, 100) == [list(sizes)]


def test_an_moe_run_with_a_routing_bias_is_refused_in_one_line_and_nothing_is_written(tmp_path, capsys):
    from trainctl.config.schema import MoEConfig

    moe = ModelConfig(family="qwen3_moe", dim=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, vocab_size=64,
                      max_seq_len=16, moe=MoEConfig(num_experts=4, experts_per_token=2, expert_ffn_dim=16,
                                                    bias_update_rate=0.01))
    make_run(tmp_path / "biased", moe)
    line = user_error([str(tmp_path / "biased")], capsys)
    assert line.startswith("error: model.moe.bias_update_rate=0.01: ") and "qwen3_moe" in line
    assert not (tmp_path / "biased" / "export").exists()
    make_run(tmp_path / "plain", replace(moe, moe=replace(moe.moe, bias_update_rate=0.0)))
    assert main([str(tmp_path / "plain")]) == 0  # the same model without the bias exports
    assert (tmp_path / "plain" / "export" / STEP / "model.safetensors").is_file()
