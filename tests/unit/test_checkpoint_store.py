"""The checkpoint store in one process: roundtrip, manifest verification and fallback, commit and pruning, async,
full disk."""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from tests.helpers import truncate, wait_for
from trainctl.train.checkpoint import store as ckpt
from trainctl.train.checkpoint.store import CheckpointError, CheckpointManager, checkpoint_dir, step_name, verify

# DCP warns on every call without a process group that it assumes a single process: that is the case here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def small_state(value: float = 1.0, size: int = 64) -> dict:
    return {"model": {"w": torch.full((size, size), value)}, "schedule": {"step": int(value)}}


def save_steps(manager: CheckpointManager, *steps: int, size: int = 64) -> None:
    for step in steps:
        manager.save(step, small_state(step, size), {"position": step}, {"tokens_seen": step * 10})
    manager.wait()


def names(manager: CheckpointManager) -> list[str]:
    return [path.name for _, path in manager.committed()]


def shard_file(path: Path) -> Path:
    (shard,) = path.glob("__0_*.distcp")
    return shard


def trained_linear(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).square().sum().backward()
    optim.step()
    return model, optim


def test_names():
    assert step_name(10) == "step-00000010"
    assert checkpoint_dir(Path("/runs/a")) == Path("/runs/a/checkpoints")


def test_roundtrip_model_optimizer_meta_and_rank_state(tmp_path):
    model, optim = trained_linear(seed=0)
    model_sd, optim_sd = get_state_dict(model, optim)
    rank_state = {"cpu_rng": torch.get_rng_state(), "data_position": 1234}
    expected_draw = torch.rand(5)
    manager = CheckpointManager(tmp_path, keep_last=2)
    manager.save(7, {"model": model_sd, "optim": optim_sd, "schedule": {"step": 7}}, rank_state,
                 {"tokens_seen": 99, "wandb_id": "abc"})
    assert names(manager) == ["step-00000007"] and manager.stats.bytes > 0

    fresh, fresh_optim = trained_linear(seed=1)
    fresh_model_sd, fresh_optim_sd = get_state_dict(fresh, fresh_optim)
    app_state = {"model": fresh_model_sd, "optim": fresh_optim_sd, "schedule": {"step": 0}}
    meta, loaded_rank_state = manager.load(manager.latest_valid(), app_state)
    set_state_dict(fresh, fresh_optim, model_state_dict=app_state["model"], optim_state_dict=app_state["optim"])

    assert meta == {"tokens_seen": 99, "wandb_id": "abc", "step": 7, "world_size": 1}
    assert app_state["schedule"] == {"step": 7}
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(fresh_optim.state[fresh.weight][key], optim.state[model.weight][key]), key
    assert loaded_rank_state["data_position"] == 1234
    torch.set_rng_state(loaded_rank_state["cpu_rng"])
    assert torch.equal(torch.rand(5), expected_draw)


def test_rank_state_dropped_when_world_size_changed(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    save_steps(manager, 1)
    meta_file = tmp_path / step_name(1) / "meta.json"
    meta_file.write_text(json.dumps({**json.loads(meta_file.read_text()), "world_size": 4}))
    meta, rank_state = manager.load(tmp_path / step_name(1), small_state(0.0))
    assert meta["world_size"] == 4 and rank_state is None


def flip_one_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("damage", "problem"),
                         [(truncate, "bytes, the manifest says"), (flip_one_byte, "content differs")])
def test_damaged_newest_falls_back_with_warning(tmp_path, caplog, damage, problem):
    manager = CheckpointManager(tmp_path, keep_last=3)
    save_steps(manager, 1, 2)
    newest = tmp_path / step_name(2)
    damage(shard_file(newest))
    problems = verify(newest)
    assert len(problems) == 1 and shard_file(newest).name in problems[0] and problem in problems[0]
    with caplog.at_level(logging.WARNING, logger="trainctl.train"):
        assert manager.latest_valid() == tmp_path / step_name(1)
    assert "step-00000002" in caplog.text and problem in caplog.text


def test_verify_reports_missing_extra_and_unreadable_manifest(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    save_steps(manager, 1)
    path = tmp_path / step_name(1)
    assert verify(path) == []
    (path / "rank-00000.pt").unlink()
    (path / "stray.bin").write_bytes(b"x")
    assert verify(path) == ["stray.bin: not in the manifest", "rank-00000.pt: missing"]
    (path / "manifest.json").write_text("{not json")
    assert verify(path)[0].startswith("manifest.json unreadable")


def test_all_damaged_raises_and_none_without_checkpoints(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    assert manager.latest_valid() is None
    save_steps(manager, 1, 2)
    for _, path in manager.committed():
        flip_one_byte(path / "meta.json")
    with pytest.raises(CheckpointError, match="no valid checkpoint under .*all 2 committed checkpoints fail"):
        manager.latest_valid()


def test_prune_keeps_exactly_keep_last_and_ignores_uncommitted(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    save_steps(manager, 1, 2, 3)
    assert names(manager) == ["step-00000002", "step-00000003"]
    # A killed save and a directory without a manifest are not checkpoints, and never push one out.
    (tmp_path / (step_name(4) + ".tmp")).mkdir()
    (tmp_path / step_name(5)).mkdir()
    assert names(manager) == ["step-00000002", "step-00000003"]
    save_steps(manager, 6)
    assert names(manager) == ["step-00000003", "step-00000006"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-00000003", "step-00000004.tmp", "step-00000005", "step-00000006"]


def test_failed_save_prunes_nothing_and_leaves_no_tmp(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path, keep_last=2)
    save_steps(manager, 1, 2)

    def broken_save(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "somewhere")

    monkeypatch.setattr(ckpt.dcp, "save", broken_save)
    failed = r"step 3 failed on rank\(s\) 0: PermissionError.*step-00000002 is intact"
    with pytest.raises(CheckpointError, match=failed):
        save_steps(manager, 3)
    assert names(manager) == ["step-00000001", "step-00000002"]
    assert not list(tmp_path.glob("*.tmp"))


def test_leftover_tmp_removed_when_a_manager_starts(tmp_path):
    save_steps(CheckpointManager(tmp_path, keep_last=2), 1)
    leftover = tmp_path / (step_name(2) + ".tmp")
    leftover.mkdir()
    (leftover / "__0_0.distcp").write_bytes(b"partial")
    CheckpointManager(tmp_path, keep_last=2)
    assert not leftover.exists() and names(CheckpointManager(tmp_path, keep_last=2)) == ["step-00000001"]


def test_resaving_a_step_replaces_it(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=3)
    save_steps(manager, 1, 2)
    flip_one_byte(shard_file(tmp_path / step_name(2)))
    assert manager.latest_valid() == tmp_path / step_name(1)
    save_steps(manager, 2)  # the run resumed from step 1 reaches step 2 again
    assert names(manager) == ["step-00000001", "step-00000002"] and verify(tmp_path / step_name(2)) == []


def test_async_save_roundtrip_with_poll_wait_and_stats(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2, async_save=True)
    state = small_state(3.0, size=256)
    manager.save(3, state, {"position": 3}, {"tokens_seen": 30})
    state["model"]["w"].add_(100.0)  # the loop goes on; DCP staged a copy before save returned
    assert names(manager) == []  # committed by poll(), never inside save()

    def committed():
        manager.poll()
        return manager.committed()

    wait_for(committed, "the async save to commit", timeout=20, interval=0.005)
    assert names(manager) == ["step-00000003"]
    target = small_state(0.0, size=256)
    manager.load(tmp_path / step_name(3), target)
    assert torch.equal(target["model"]["w"], torch.full((256, 256), 3.0))
    stats = manager.stats
    manifest = json.loads((tmp_path / step_name(3) / "manifest.json").read_text())
    assert stats.step == 3 and 0 < stats.blocking_s <= stats.total_s
    assert stats.bytes == sum(entry["size"] for entry in manifest["files"].values()) > 256 * 256 * 4

    manager.save(4, small_state(4.0), {"position": 4}, {})
    manager.save(5, small_state(5.0), {"position": 5}, {})  # commits step 4 first
    assert names(manager) == ["step-00000003", "step-00000004"]
    manager.wait()
    manager.wait()  # nothing pending: a no-op
    assert names(manager) == ["step-00000004", "step-00000005"]

    target = small_state(0.0)
    meta, rank_state = manager.load(manager.latest_valid(), target)
    assert torch.equal(target["model"]["w"], torch.full((64, 64), 5.0))
    assert meta == {"step": 5, "world_size": 1} and rank_state == {"position": 5}


@pytest.fixture
def small_fs(tmp_path):
    """A 1 MiB tmpfs: a real ENOSPC, with no risk to the machine's disk."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)], check=True)
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=True)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_disk_full_keeps_previous_checkpoint(small_fs, async_save):
    manager = CheckpointManager(small_fs / "checkpoints", keep_last=2, async_save=async_save)
    save_steps(manager, 1, size=32)
    full = r"checkpoint step 2: disk full under .* free of 1.0 MiB.*step-00000001 is intact"
    with pytest.raises(CheckpointError, match=full):
        save_steps(manager, 2, size=1024)  # 4 MiB of fp32
    assert names(manager) == ["step-00000001"]
    assert verify(small_fs / "checkpoints" / step_name(1)) == []
    assert not list((small_fs / "checkpoints").glob("*.tmp"))


@pytest.fixture
def file_size_limit():
    """A soft file size limit of 256 KiB in this process (`ulimit -f 256`): a real EFBIG (Python ignores SIGXFSZ)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, hard))
    try:
        yield 256 << 10
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_file_past_the_size_limit_is_named_not_an_unexpected_pos(tmp_path, file_size_limit, async_save):
    manager = CheckpointManager(tmp_path / "checkpoints", keep_last=2, async_save=async_save)
    save_steps(manager, 1, size=32)
    limit = r"checkpoint step 2: a file under .* reached the file size limit \(256.0 KiB, `ulimit -f`\)"
    with pytest.raises(CheckpointError, match=limit + r".*step-00000001 is intact; raise the limit") as err:
        save_steps(manager, 2, size=1024)  # 4 MiB of fp32 in one shard file
    assert "unexpected pos" not in str(err.value)
    assert names(manager) == ["step-00000001"]
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))


def test_commit_after_resuming_from_older_step_removes_the_abandoned_newer_ones(tmp_path, caplog):
    manager = CheckpointManager(tmp_path, keep_last=3)
    save_steps(manager, 10, 20, 30)
    # Resumed from step 10 (say 20 and 30 were damaged): they must not win the next resume, nor push out step 15.
    with caplog.at_level(logging.WARNING, logger="trainctl.train"):
        save_steps(manager, 15)
    assert names(manager) == ["step-00000010", "step-00000015"]
    assert "step-00000020, step-00000030" in caplog.text


def test_an_async_save_of_cuda_state_waits_for_the_pinned_copy_only(tmp_path, monkeypatch):
    """On CUDA, async saves stage through DCP's DefaultStager (pinned host buffers, reused): save() returns once
    the device-to-host copy is done, while the write goes on (a CPU stand-in for the CUDA-only stager)."""
    import threading
    from concurrent.futures import Future

    stager, seen = object(), {}
    staged, uploaded = Future(), Future()
    monkeypatch.setattr(ckpt, "pinned_stager", lambda: stager)

    class Response:
        staging_completion, upload_completion = staged, uploaded

    def async_save(state, *, checkpoint_id, process_group, async_stager):
        seen["stager"] = async_stager
        staged.add_done_callback(lambda _: seen.setdefault("staged_before_return", True))
        threading.Timer(0.2, lambda: staged.set_result(None)).start()
        return Response()

    monkeypatch.setattr(ckpt.dcp, "async_save", async_save)
    manager = CheckpointManager(tmp_path, keep_last=2, async_save=True, device="cuda")
    manager._stager = stager  # the fake has no close(): nothing is released here
    manager.save(1, small_state(), {}, {})
    assert seen == {"stager": stager, "staged_before_return": True}
    assert not uploaded.done()  # the write itself is not waited for by save()
    uploaded.set_result(None)
    manager._stager = None
    manager.wait()


def test_any_write_past_the_size_limit_names_the_file_and_the_limit(tmp_path, file_size_limit):
    """Outside a checkpoint too (e.g. the data cache a worker builds): the worker's one failure line says what to do."""
    from trainctl.train.errors import storage_line

    with pytest.raises(OSError) as err, open(tmp_path / "big.bin", "wb") as f:
        f.write(b"\0" * (file_size_limit + 1))
    err.value.filename = str(tmp_path / "big.bin")  # a write's OSError has none; the caller's path is what users see
    line = storage_line(err.value)
    assert line == (f"{tmp_path / 'big.bin'}: the write reached the file size limit (0.2 MiB, `ulimit -f`); raise it "
                    "(ulimit -f unlimited) in the shell or job script that starts the run")
    assert storage_line(ValueError("x")) is None and storage_line(FileNotFoundError(2, "No such file")) is None
