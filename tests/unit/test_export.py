"""Checkpoint -> safetensors export: single file, shards, tied embeddings, verified checkpoint choice, user errors.

Real DCP checkpoints with real manifests; damaged bytes, metadata and output paths each give exit 2, one
`error:` line, no traceback and nothing written. The CLI in a subprocess is in tests/dist/test_export_cli.py.
"""

from __future__ import annotations

import json
import resource
import shutil
import signal
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from tests.helpers import tool_argv
from trainctl.config.load import to_yaml
from trainctl.config.schema import ModelConfig, RunConfig
from trainctl.core import model_record
from trainctl.core.checkpoints import MANIFEST, list_files, sha256
from trainctl.core.tool_options import ExportOptions
from trainctl.models import export as export_module
from trainctl.models.build import build_model
from trainctl.models.hf import from_hf
from trainctl.models.hf_folder import plan_shards

STEP = "step-00000005"
SMALL = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64)  # quick to save and hash
# The fixture saves in one process without a process group, on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def main(args: list[str]) -> int:
    """The exporter's child entry on options written as a user types them: RUN_DIR --flag value ..."""
    return export_module.main(tool_argv(ExportOptions, args))


def write_manifest(ckpt: Path, step: int) -> None:
    """The manifest the worker commits: every other file's size and sha256 (re-hashing makes damage "valid")."""
    rels = [rel for rel in list_files(ckpt) if rel != MANIFEST]
    files = {rel: {"size": (ckpt / rel).stat().st_size, "sha256": sha256(ckpt / rel)} for rel in rels}
    (ckpt / MANIFEST).write_text(json.dumps({"step": step, "world_size": 1, "files": files}))


def make_run(root: Path, model_cfg: ModelConfig, steps: tuple[int, ...] = (5,)) -> dict[int, dict[str, torch.Tensor]]:
    """A run directory with one committed DCP checkpoint per step (model and optimizer, an optimizer step apart).

    Returns the model's tensors at each step.
    """
    torch.manual_seed(0)
    model = build_model(model_cfg, device="cpu")
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    root.mkdir(parents=True)
    (root / "config.yaml").write_text(to_yaml(RunConfig(model=model_cfg)))
    tensors = {}
    for step in steps:
        model(torch.zeros(1, 8, dtype=torch.long)).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        ckpt = root / "checkpoints" / f"step-{step:08d}"
        dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=str(ckpt), no_dist=True)
        (ckpt / "meta.json").write_text(json.dumps({"step": step, "model": model_record.record(model_cfg)}))
        write_manifest(ckpt, step)
        tensors[step] = {name: t.detach().clone() for name, t in model.state_dict().items()}
    return tensors


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


def as_trainctl(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """An export's Hugging Face tensors back under trainctl's names and rotary layout."""
    return dict(from_hf(name, t, cfg) for name, t in tensors.items())


def assert_same_tensors(exported: dict[str, torch.Tensor], original: dict[str, torch.Tensor],
                        cfg: ModelConfig | None = None) -> None:
    """The export holds exactly the model's tensors, bit for bit, in Hugging Face's names and layout."""
    assert all(name.startswith(("model.", "lm_head.")) for name in exported), sorted(exported)[:3]
    exported = as_trainctl(exported, cfg or ModelConfig())
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


# ---------------------------------------------------------------- damaged checkpoints and unwritable outputs
OLDER, NEWER = "step-00000003", "step-00000005"
SHARD = "__0_0.distcp"
FS_IOC_GETFLAGS, FS_IOC_SETFLAGS, FS_IMMUTABLE_FL = 0x80086601, 0x40086602, 0x10  # linux/fs.h, 64-bit


@pytest.fixture(scope="module")
def saved_two(tmp_path_factory):
    root = tmp_path_factory.mktemp("saved_two")
    return root / "run", make_run(root / "run", SMALL, steps=(3, 5))


@pytest.fixture
def two(saved_two, tmp_path):
    """A private run with committed checkpoints at steps 3 and 5 (different weights): (run_dir, tensors by step)."""
    template, tensors = saved_two
    shutil.copytree(template, tmp_path / "run")
    return tmp_path / "run", tensors


def tree(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


def refused(args: list[str], capsys, root: Path) -> str:
    """Exit 2, exactly one line on stderr (the error), no traceback, and nothing written under `root`."""
    before = tree(root)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert tree(root) == before, "the failed export left something behind"
    return lines[0]


def flip_bytes(path: Path, count: int = 64) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + count] = bytes(b ^ 0xFF for b in data[middle:middle + count])
    path.write_bytes(bytes(data))


def exported(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "model.safetensors")


def test_flipped_bytes_in_a_shard_refuse_the_named_step_and_the_default_falls_back(two, tmp_path, capsys):
    run_dir, tensors = two
    flip_bytes(run_dir / "checkpoints" / NEWER / SHARD)
    line = refused([str(run_dir), "--checkpoint", NEWER], capsys, tmp_path)
    assert f"--checkpoint {NEWER}: fails verification: {SHARD}: content differs from the manifest (sha256)" in line

    assert main([str(run_dir)]) == 0
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [
        f"warning: skipped {NEWER}: {SHARD}: content differs from the manifest (sha256)"
    ]
    assert "exported step 3" in captured.out
    assert sorted(p.name for p in (run_dir / "export").iterdir()) == [OLDER]
    assert not torch.equal(tensors[3]["output.weight"], tensors[5]["output.weight"]), "the two steps must differ"
    assert_same_tensors(exported(run_dir / "export" / OLDER), tensors[3], SMALL)


def test_a_truncated_shard_is_skipped_or_refused(two, tmp_path, capsys):
    run_dir, tensors = two
    shard = run_dir / "checkpoints" / NEWER / SHARD
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    assert "bytes, the manifest says" in refused([str(run_dir), "--checkpoint", NEWER], capsys, tmp_path)
    assert main([str(run_dir)]) == 0
    assert "warning: skipped step-00000005: __0_0.distcp:" in capsys.readouterr().err
    assert_same_tensors(exported(run_dir / "export" / OLDER), tensors[3], SMALL)


def test_a_truncated_shard_that_verifies_fails_in_dcp_with_one_line(two, tmp_path, capsys):
    run_dir, _ = two
    ckpt = run_dir / "checkpoints" / NEWER
    with open(ckpt / SHARD, "r+b") as f:
        f.truncate(1000)
    write_manifest(ckpt, 5)  # the manifest agrees: only DCP's read can notice
    assert "DCP cannot read it: EOFError" in refused([str(run_dir)], capsys, tmp_path)


def test_garbage_metadata_that_verifies_is_one_line(two, tmp_path, capsys):
    run_dir, _ = two
    ckpt = run_dir / "checkpoints" / NEWER
    (ckpt / ".metadata").write_bytes(bytes(range(256)) * 4)
    write_manifest(ckpt, 5)
    line = refused([str(run_dir)], capsys, tmp_path)
    assert f"{ckpt / '.metadata'}: not DCP checkpoint metadata" in line
    (ckpt / ".metadata").write_bytes(json.dumps({"not": "pickle"}).encode())
    write_manifest(ckpt, 5)
    assert "not DCP checkpoint metadata" in refused([str(run_dir), "--checkpoint", NEWER], capsys, tmp_path)


def test_no_valid_checkpoint_is_one_line_naming_each(two, tmp_path, capsys):
    run_dir, _ = two
    flip_bytes(run_dir / "checkpoints" / NEWER / SHARD)
    (run_dir / "checkpoints" / OLDER / "extra.bin").write_bytes(b"x")
    line = refused([str(run_dir)], capsys, tmp_path)
    assert "no committed checkpoint verifies" in line
    assert f"{NEWER}: {SHARD}: content differs" in line and f"{OLDER}: extra.bin: not in the manifest" in line


def test_a_checkpoint_without_manifest_is_not_committed(two, tmp_path, capsys):
    run_dir, tensors = two
    (run_dir / "checkpoints" / NEWER / MANIFEST).unlink()
    assert "no manifest.json in it" in refused([str(run_dir), "--checkpoint", NEWER], capsys, tmp_path)
    assert main([str(run_dir)]) == 0  # uncommitted: not a candidate at all, so no warning either
    assert capsys.readouterr().err == ""
    assert_same_tensors(exported(run_dir / "export" / OLDER), tensors[3], SMALL)


def test_out_under_a_regular_file_is_one_line(two, tmp_path, capsys):
    run_dir, _ = two
    (tmp_path / "afile").write_text("x")  # fails as root too, unlike a chmod
    under_a_file = tmp_path / "afile" / "sub" / "deeper"
    assert "Not a directory" in refused([str(run_dir), "--out", str(under_a_file)], capsys, tmp_path)
    assert "is a file, not a folder" in refused([str(run_dir), "--out", str(tmp_path / "afile")], capsys, tmp_path)


def test_out_that_is_a_non_empty_folder_or_inside_the_checkpoints_is_refused(two, tmp_path, capsys):
    run_dir, _ = two
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    assert "already exists and is not empty" in refused(
        [str(run_dir), "--out", str(tmp_path / "taken")], capsys, tmp_path
    )
    inside = run_dir / "checkpoints" / NEWER / "export"
    assert "fails the checkpoint's verification" in refused([str(run_dir), "--out", str(inside)], capsys, tmp_path)


def set_immutable(path: Path, on: bool) -> None:
    """chattr +i / -i without a subprocess: the flag stops writes even for root."""
    import array
    import fcntl
    import os

    fd = os.open(path, os.O_RDONLY)
    try:
        flags = array.array("l", [0])
        fcntl.ioctl(fd, FS_IOC_GETFLAGS, flags, True)
        flags[0] = flags[0] | FS_IMMUTABLE_FL if on else flags[0] & ~FS_IMMUTABLE_FL
        fcntl.ioctl(fd, FS_IOC_SETFLAGS, flags)
    finally:
        os.close(fd)


def test_out_in_an_unwritable_folder_is_one_line(two, tmp_path, capsys):
    run_dir, _ = two
    locked = tmp_path / "locked"
    locked.mkdir()
    try:
        set_immutable(locked, True)
    except OSError as exc:
        pytest.skip(f"this filesystem or user cannot set the immutable flag: {exc}")
    try:
        line = refused([str(run_dir), "--out", str(locked / "sub" / "out")], capsys, tmp_path)
    finally:
        set_immutable(locked, False)
    assert f"--out {locked / 'sub' / 'out'}: cannot write the export there: Operation not permitted" in line


def test_a_full_disk_mid_write_is_one_line_and_removes_the_partial_export(two, tmp_path, capsys):
    # RLIMIT_FSIZE makes the kernel fail the shard's write part way (EFBIG), as a full disk fails it with ENOSPC.
    run_dir, _ = two
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, hard))  # the weights are ~400 KB
    try:
        line = refused([str(run_dir), "--out", str(tmp_path / "new" / "out")], capsys, tmp_path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert f"--out {tmp_path / 'new' / 'out'}: cannot write the export there:" in line and "File too large" in line


def test_run_dir_without_or_with_a_broken_config_is_one_line(two, tmp_path, capsys):
    run_dir, _ = two
    (run_dir / "config.yaml").write_text("model: {dim: [\n")
    assert "cannot be read as a run config: ParserError" in refused([str(run_dir)], capsys, tmp_path)
    (run_dir / "config.yaml").write_bytes(b"\xff\xfe\x00")
    assert "cannot be read as a run config: UnicodeDecodeError" in refused([str(run_dir)], capsys, tmp_path)
    (run_dir / "config.yaml").write_text("[1, 2]\n")
    assert "cannot be read as a run config" in refused([str(run_dir)], capsys, tmp_path)
    (run_dir / "config.yaml").unlink()
    assert "not a run directory (no config.yaml in it)" in refused([str(run_dir)], capsys, tmp_path)
