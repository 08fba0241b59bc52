"""scripts/gpu_out_check.py: what the device tool would leave behind under $OUT is named, before the call ends."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import gpu_out_check  # noqa: E402


def _files(root: Path, *names: str, size: int = 10) -> None:
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"x" * size)


def test_the_proofs_own_layout_comes_back(tmp_path):
    # Every stage's file in one $OUT (the calls split them; --rehearse without parts writes six).
    _files(tmp_path, "proof.log", "loop.json", "variants-1of2.json", "variants-1of2.md", "variants-2of2.json",
           "variants-2of2.md", "loss_head.json", "titan.json")
    assert gpu_out_check.problems(tmp_path) == []
    assert gpu_out_check.main([str(tmp_path)]) == 0
    (tmp_path / "titan.json").unlink()
    _files(tmp_path, "a/b/deepest-allowed.txt")
    assert gpu_out_check.problems(tmp_path) == []


def test_a_ninth_file_is_named(tmp_path):
    _files(tmp_path, *(f"f{i}.json" for i in range(9)))
    assert gpu_out_check.problems(tmp_path) == ["9 files; at most 8 come back"]


def test_three_folders_deep_is_named(tmp_path):
    _files(tmp_path, "variants-runs/eager/metrics.jsonl")
    assert gpu_out_check.problems(tmp_path) == []
    _files(tmp_path, "variants-runs/eager/logs/rank0.log")
    (line,) = gpu_out_check.problems(tmp_path)
    assert line.startswith("variants-runs/eager/logs/rank0.log: 3 folders deep")


def test_sizes_and_names_are_named(tmp_path):
    _files(tmp_path, "big.log", size=16 * 2**20 + 1)
    _files(tmp_path, "ok.log", size=16 * 2**20)
    _files(tmp_path, "bench loop.json")
    lines = gpu_out_check.problems(tmp_path)
    assert len(lines) == 2 and lines[0].startswith("bench loop.json: name") and lines[1].startswith("big.log: 16.0 MiB")
    _files(tmp_path, "c.log", "d.log", "e.log", size=16 * 2**20)
    assert gpu_out_check.problems(tmp_path)[-1].startswith("80.0 MiB in all")


def test_a_link_is_named(tmp_path):
    _files(tmp_path, "proof.log")
    (tmp_path / "latest.log").symlink_to(tmp_path / "proof.log")
    assert gpu_out_check.problems(tmp_path) == ["latest.log: not a plain file or folder"]
