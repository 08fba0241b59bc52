"""Export from damaged checkpoints and to unwritable outputs: exit 2, one `error:` line, no traceback, nothing
written; a damaged newest checkpoint is skipped with a warning when no checkpoint was named.
"""

from __future__ import annotations

import json
import resource
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.unit.export_checkpoints import SHARD, SMALL, assert_same_tensors, flip_bytes, main, make_run, write_manifest
from trainctl.core.checkpoints import MANIFEST

OLDER, NEWER = "step-00000003", "step-00000005"
FS_IOC_GETFLAGS, FS_IOC_SETFLAGS, FS_IMMUTABLE_FL = 0x80086601, 0x40086602, 0x10  # linux/fs.h, 64-bit
# The fixture saves in one process without a process group, on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


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
