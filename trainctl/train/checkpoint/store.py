"""Distributed checkpoints on disk: DCP shards plus per-rank state, committed atomically, verified on load.

Layout under RUN_DIR/checkpoints/ (`checkpoint_dir`):

    step-00000100/          committed: only a directory with exactly this name and a manifest counts
        .metadata           DCP's index of every tensor shard (DCP's coordinator writes it)
        __R_N.distcp        DCP's data written by DCP rank R: its shards of app_state
        rank-0000R.pt       rank R's private state (torch.save): RNG states, data position
        meta.json           the caller's meta plus `step` and `world_size` (rank 0)
        manifest.json       relative path, size and sha256 of every other file (rank 0, last)
    step-00000200.tmp/      a save in flight, failed or killed: never counted, removed when a manager starts

API (call every method on every rank in the same order: they run collectives when a process group is up):

    CheckpointManager(root, keep_last, async_save=False, process_group=None)
        .save(step, app_state, rank_state, meta)   sync: committed on return; async: committed by poll()/wait()
        .poll()                                    async: commit a finished background save (each step boundary)
        .wait()                                    block until a pending save is committed (before exit)
        .committed() -> [(step, path)]             committed checkpoints, oldest first
        .latest_valid(root=None) -> Path | None    newest committed checkpoint that verifies, same on every rank
        .load(path, app_state) -> (meta, rank_state | None)
        .stats -> SaveStats | None                 the last committed save: blocking s, total s, bytes
    verify(path, part=0, parts=1) -> [problem]     manifest check (empty list: valid)
    list_committed(root), checkpoint_dir(run_dir), step_name(step), CheckpointError

Commit: every rank writes its files into step-N.tmp/ and hashes what it wrote; the parts are gathered
on rank 0, which writes the manifest only if every part succeeded, fsyncs, renames .tmp to step-N and
prunes beyond keep_last; its verdict is broadcast so every rank returns or raises CheckpointError alike.
Async: rank state and meta are written at once, DCP stages app_state to CPU memory and writes it in a
background thread; each rank then hashes its files in a thread of ours. poll() commits once an
all_reduce says every rank's part is done (so no rank enters the commit collectives alone).
Process groups: two gloo groups of our own over all ranks, one for DCP (async_save needs a CPU
backend, and its background collectives must not share a group with training or with us) and one
for our agreement collectives (CPU tensors whatever the training backend). The root must be a
filesystem every rank sees (DCP's coordinator writes .metadata; loads read every rank's shards).
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from trainctl.core.checkpoints import (  # noqa: F401  (checkpoint_dir, step_name, list_committed: re-exported)
    MANIFEST,
    META,
    TMP_SUFFIX,
    checkpoint_dir,
    list_committed,
    list_files,
    step_name,
    verify,
)
from trainctl.train.checkpoint.failure import SAVE_ERRORS, Part, describe, human
from trainctl.train.checkpoint.manifest import fsync_dir, hash_files, write_bytes
from trainctl.train.checkpoint.state import quantized_state_classes
from trainctl.train.errors import WorkerError

log = logging.getLogger("trainctl.train")



class CheckpointError(WorkerError):  # exit 1: the run stopped on purpose
    """A checkpoint could not be saved or loaded; the one-line message says why and what to do."""


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def _trash_name(path: Path) -> Path:
    return path.with_name(path.name + ".old" + TMP_SUFFIX)


@dataclass(frozen=True)
class SaveStats:
    """The last committed save, for benchmarks."""

    step: int
    blocking_s: float  # the training loop was held: save() plus the commit inside poll()/wait()
    total_s: float  # save() start to commit end (async: includes the wait for the poll that commits)
    bytes: int  # size of the committed checkpoint, every rank's files


@dataclass
class _Pending:
    step: int
    tmp: Path
    started: float
    blocking_s: float
    part: Future  # -> Part, once DCP's write is done and this rank's files are hashed


def pinned_stager():
    """DCP's stager for CUDA state: reused pinned host buffers, copies on a side stream (non-blocking); None on a
    torch without it (the default stager then copies into pageable memory, blocking longer)."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:
        return None
    return DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False, use_async_staging=True,
                                        use_non_blocking_copy=True))


class CheckpointManager:
    """Saves, commits, prunes, verifies and loads the checkpoints under one root directory.

    process_group: the group DCP uses (over all ranks, with a CPU backend for async); None: a new gloo group.
    Construction is collective: every rank must create its manager at the same point.
    """

    def __init__(self, root: Path, keep_last: int, async_save: bool = False, process_group=None,
                 device: str = "cpu", before_commit: Callable[[int], None] | None = None):
        if keep_last < 1:
            raise ValueError(f"keep_last={keep_last}: must be >= 1")
        self.root, self.keep_last, self.async_save = Path(root), keep_last, async_save
        self.stats: SaveStats | None = None
        self.before_commit = before_commit  # hooks.before_commit (a test seam), None in production
        self._pending: _Pending | None = None
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-hash") if async_save else None
        self._stager = pinned_stager() if async_save and device == "cuda" else None
        self._ctl = self._dcp_group = None
        self.rank, self.world_size, self._dcp_rank = 0, 1, 0
        if dist.is_available() and dist.is_initialized():
            self._ctl = dist.new_group(backend="gloo")
            self._dcp_group = process_group or dist.new_group(backend="gloo")
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            self._dcp_rank = dist.get_rank(self._dcp_group)
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            self._remove_leftovers()
        self._everyone(True)  # a barrier: nobody writes into root before rank 0 cleared what a killed save left

    # Collectives over our gloo group; without a process group they return this process's value.
    def _all_gather(self, obj) -> list:
        if self._ctl is None:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._ctl)
        return out

    def _broadcast(self, obj):
        if self._ctl is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._ctl)
        return box[0]

    def _everyone(self, flag: bool) -> bool:
        if self._ctl is None:
            return flag
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._ctl)
        return bool(t.item())

    def save(self, step: int, app_state: dict, rank_state: dict, meta: dict) -> None:
        """Write checkpoint `step` on every rank; sync: committed (or CheckpointError) on return, async: by
        poll()/wait().

        app_state: name -> state dict or Stateful, saved with DCP; rank_state: this rank's picklable dict;
        meta: JSON-able, rank 0 writes it.
        """
        self.wait()  # one save in flight at a time: a second async_save would race the first one's commit
        started = time.perf_counter()
        tmp = self.root / (step_name(step) + TMP_SUFFIX)
        part = self._write_private(tmp, step, rank_state, meta)
        if not self.async_save:
            try:
                dcp.save(app_state, checkpoint_id=tmp, process_group=self._dcp_group)
            except SAVE_ERRORS as exc:
                part.fail(exc, tmp)
            self._commit(step, tmp, self._hash_own(tmp, part), started, 0.0, started)
            return
        try:
            written = dcp.async_save(app_state, checkpoint_id=tmp, process_group=self._dcp_group,
                                     async_stager=self._stager)
            # The loop waits for the device-to-host copy into the stager's pinned buffers only: after it, the
            # next optimizer step may change the parameters while the write goes on in the background.
            staged = getattr(written, "staging_completion", None)
            if staged is not None:
                staged.result()
        except SAVE_ERRORS as exc:
            # Staging failed on this rank only; the others' writers wait for it in DCP's collectives,
            # so end this process (torchrun stops the rest) rather than train on.
            message = f"checkpoint step {step}: staging for the background save failed: {describe(exc)}"
            raise CheckpointError(message) from None
        written = getattr(written, "upload_completion", written)  # an AsyncSaveResponse when DCP stages asynchronously
        future = self._hasher.submit(self._finish_part, tmp, part, written)
        self._pending = _Pending(step, tmp, started, time.perf_counter() - started, future)

    def _write_private(self, tmp: Path, step: int, rank_state: dict, meta: dict) -> Part:
        """This rank's own file (and meta.json on rank 0), small, written before DCP's shards."""
        part = Part()
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            buffer = io.BytesIO()
            torch.save(rank_state, buffer)
            write_bytes(tmp / _rank_file(self.rank), buffer.getvalue())
            if self.rank == 0:
                record = {**meta, "step": step, "world_size": self.world_size}
                write_bytes(tmp / META, json.dumps(record, indent=2).encode())
        except OSError as exc:
            part.fail(exc, tmp)
        return part

    def _finish_part(self, tmp: Path, part: Part, written: Future) -> Part:
        """Background: wait for DCP's write, then hash this rank's files."""
        try:
            written.result()
        except SAVE_ERRORS as exc:
            part.fail(exc, tmp)
        return self._hash_own(tmp, part)

    def _hash_own(self, tmp: Path, part: Part) -> Part:
        """Hash the files this rank wrote, so the hashing of a big checkpoint is spread over the ranks."""
        if part.error is None:
            try:
                names = [p.name for p in tmp.glob(f"__{self._dcp_rank}_*")] + [_rank_file(self.rank)]
                part.files = hash_files(tmp, names)
            except OSError as exc:
                part.fail(exc, tmp)
        return part

    def poll(self) -> None:
        """Commit a finished async save if every rank's part is done; a no-op otherwise (call at each step boundary)."""
        if self._pending is not None and self._everyone(self._pending.part.done()):
            self._commit_pending(time.perf_counter())

    def close(self) -> None:
        """Commit what is pending, then release the staging buffers and threads."""
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            if self._hasher is not None:
                self._hasher.shutdown(wait=True)

    def wait(self) -> None:
        """Block until a pending save is committed (raises CheckpointError if it failed); a no-op when none is."""
        if self._pending is not None:
            held = time.perf_counter()
            self._pending.part.result()
            self._commit_pending(held)

    def _commit_pending(self, held: float) -> None:
        pending, self._pending = self._pending, None
        self._commit(pending.step, pending.tmp, pending.part.result(), pending.started, pending.blocking_s, held)

    def _commit(self, step: int, tmp: Path, part: Part, started: float, blocking_s: float, held: float) -> None:
        """Every rank: gather the parts on rank 0, which commits or cleans up; raise its verdict everywhere.

        held: when the loop started waiting for this commit (blocking time = blocking_s + now - held).
        """
        parts = self._all_gather(part)
        if self.before_commit is not None:
            self.before_commit(step)
        verdict = self._seal(step, tmp, parts) if self.rank == 0 else None
        error, size = self._broadcast(verdict)
        if error is not None:
            raise CheckpointError(error)
        now = time.perf_counter()
        self.stats = SaveStats(step, blocking_s + now - held, now - started, size)

    def _seal(self, step: int, tmp: Path, parts: list[Part]) -> tuple[str | None, int]:
        """Rank 0: manifest, fsync, rename, prune, if every part succeeded; otherwise remove tmp. -> (error, bytes)."""
        failed = [(rank, p) for rank, p in enumerate(parts) if p.error is not None]
        if not failed:
            try:
                size = self._publish(step, tmp, parts)
                self._prune(step)
                return None, size
            except OSError as exc:
                failed = [(0, Part())]
                failed[0][1].fail(exc, tmp)
        partial = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file()) if tmp.is_dir() else 0
        shutil.rmtree(tmp, ignore_errors=True)
        return self._failure_message(step, failed, partial), 0

    def _publish(self, step: int, tmp: Path, parts: list[Part]) -> int:
        files = {rel: entry for p in parts for rel, entry in p.files.items()}
        # .metadata, meta.json, and whatever a newer DCP names differently: rank 0 hashes what no rank claimed.
        files.update(hash_files(tmp, [rel for rel in list_files(tmp) if rel not in files]))
        manifest = {"step": step, "world_size": self.world_size, "files": dict(sorted(files.items()))}
        write_bytes(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
        fsync_dir(tmp)  # every writer fsynced its files (DCP too, sync_files=True); now their names
        final = self.root / step_name(step)
        replaced = _trash_name(final)
        if final.exists():  # a run that resumed from an older checkpoint writes this step again
            # Renames only between the two names: no window without a checkpoint of this step.
            os.rename(final, replaced)
        os.rename(tmp, final)
        fsync_dir(self.root)
        shutil.rmtree(replaced, ignore_errors=True)
        return sum(entry["size"] for entry in files.values())

    def _failure_message(self, step: int, failed: list[tuple[int, Part]], partial: int) -> str:
        previous = self.committed()
        kept = (f"the previous checkpoint {previous[-1][1].name} is intact" if previous
                else "there is no earlier checkpoint")
        if any(p.disk_full for _, p in failed):
            usage = shutil.disk_usage(self.root)
            return (
                f"checkpoint step {step}: disk full under {self.root} (it failed after writing {human(partial)}; "
                f"{human(usage.free)} free of {human(usage.total)} now that the partial save is removed); {kept}; "
                f"free space, lower checkpoint.keep_last or put the run on a larger filesystem"
            )
        if limits := [p.file_limit for _, p in failed if p.file_limit]:
            limit = human(min(limits))
            return (f"checkpoint step {step}: a file under {self.root} reached the file size limit ({limit}, "
                    f"`ulimit -f`) after {human(partial)} were written; {kept}; raise the limit (ulimit -f unlimited) "
                    "in the shell or job script that starts the run")
        ranks = ", ".join(str(rank) for rank, _ in failed)
        return f"checkpoint step {step} failed on rank(s) {ranks}: {failed[0][1].error}; {kept}"

    def _prune(self, step: int) -> None:
        """Rank 0, right after committing `step`: drop the oldest beyond keep_last, and every one newer than `step`.

        Newer ones exist when the run resumed from an older checkpoint (the newest failed verification, or
        checkpoint.resume named an older one): they belong to an abandoned future and must not win the next resume.
        """
        committed = self.committed()
        newer = [path for s, path in committed if s > step]
        if newer:
            log.warning("removing checkpoints newer than the committed step %d: %s", step,
                        ", ".join(p.name for p in newer))
        for path in newer + [path for s, path in committed if s <= step][: -self.keep_last]:
            try:  # rename first: a kill mid-delete leaves a .tmp, never a half checkpoint that looks committed
                os.rename(path, _trash_name(path))
                shutil.rmtree(_trash_name(path))
            except OSError as exc:
                log.warning("could not prune checkpoint %s: %s", path, exc)

    def _remove_leftovers(self) -> None:
        for path in self.root.glob("*" + TMP_SUFFIX):
            log.warning("removing %s: a checkpoint save that never committed", path)
            shutil.rmtree(path, ignore_errors=True)

    def committed(self) -> list[tuple[int, Path]]:
        return list_committed(self.root)

    def latest_valid(self, root: Path | None = None) -> Path | None:
        """The newest committed checkpoint under root (default: ours) that verifies; None if there is none.

        Rank 0 lists, every rank verifies a share of the files, all ranks see every problem, so all decide
        alike. A damaged checkpoint is skipped with a warning; CheckpointError if none verifies.
        """
        root = Path(root or self.root)
        candidates, newest_problem = self._broadcast(list_committed(root) if self.rank == 0 else None), None
        for _, path in reversed(candidates):
            shares = self._all_gather(verify(path, self.rank, self.world_size))
            problems = list(dict.fromkeys(p for share in shares for p in share))
            if not problems:
                return path
            newest_problem = newest_problem or f"{path.name}: {problems[0]}"
            if self.rank == 0:
                log.warning("checkpoint %s is damaged, falling back to an older one: %s", path, "; ".join(problems))
        if candidates:
            raise CheckpointError(
                f"no valid checkpoint under {root}: all {len(candidates)} committed checkpoints fail verification "
                f"(newest {newest_problem}); delete or repair them, or set checkpoint.resume=never to start fresh"
            )
        return None

    def load(self, path: Path, app_state: dict) -> tuple[dict, dict | None]:
        """Load checkpoint `path` into app_state in place (DCP reshards to the current layout).

        Returns (meta, rank_state): rank_state is this rank's file, or None when it has none or the world size changed.
        """
        path = Path(path)
        try:
            meta = json.loads((path / META).read_text())
            with torch.serialization.safe_globals(quantized_state_classes()):
                dcp.load(app_state, checkpoint_id=path, process_group=self._dcp_group)
        except (OSError, ValueError, CheckpointException) as exc:
            raise CheckpointError(f"cannot load checkpoint {path}: {describe(exc)}") from None
        own = path / _rank_file(self.rank)
        if meta.get("world_size") != self.world_size or not own.is_file():
            return meta, None
        # Not weights_only: RNG states may hold numpy arrays; the file is ours (DCP's .metadata is a pickle too).
        return meta, torch.load(own, weights_only=False)
