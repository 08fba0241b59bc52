"""Checkpoint save speed: sync save, async save (loop blocking time, time to commit), next to raw disk write speed.

Builds a Llama (trainctl.models.llama) of the chosen shape with AdamW state (one real optimizer step),
then, `--repeats` times, each into a fresh directory under --dir:

    sync       CheckpointManager(async_save=False).save(): DCP write + hash + manifest + fsync + rename
    async      CheckpointManager(async_save=True).save() until it returns (what the training loop waits for),
               and until wait() has committed it (write + hash + commit in the background)
    verify     trainctl.train.checkpoint.store.verify of the committed checkpoint (what a resume pays first)
    raw write  the same number of bytes written `dd if=/dev/zero bs=4M conv=fsync` style, every rank its
               share at once (with --nproc N, as many writers as DCP has), into the same directory

Medians over the repeats are printed as a table and written as JSON (--out). With --nproc N > 1 the script
restarts itself under torchrun: the model is FSDP2-sharded over N gloo ranks, so each rank writes its shard.

    python scripts/bench_checkpoint.py [--dim 512] [--layers 8] [--vocab 8192] [--nproc 1] [--repeats 3]
                                       [--dir runs/bench-checkpoint] [--out bench_checkpoint.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainctl.config.schema import ClusterConfig, ModelConfig, OptimConfig
from trainctl.models.build import build_model
from trainctl.models.common.decoder import count_params
from trainctl.train.checkpoint import state as checkpoint_state
from trainctl.train.checkpoint.store import CheckpointManager, list_committed, verify
from trainctl.train.optim import build_optimizer
from trainctl.train.parallel import distributed

BLOCK = 4 << 20  # dd's bs=4M
ARGS_ENV = "BENCH_CHECKPOINT_ARGS"  # the command line, for the ranks torchrun starts


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--nproc", type=int, default=1, help="ranks (torchrun --standalone) writing the checkpoint")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", type=Path, default=Path("runs/bench-checkpoint"),
                   help="where to write (removed afterwards)")
    p.add_argument("--out", type=Path, default=None, help="JSON results (rank 0)")
    return p.parse_args(argv)


def relaunch_under_torchrun(args: argparse.Namespace, argv: list[str]) -> int:
    """--nproc > 1 from a plain shell: run this same script on N ranks.

    The arguments travel in the environment: torchrun's parser would take the script's --nproc for an
    abbreviation of its own --nproc-per-node.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}", __file__]
    threads = max(1, (os.cpu_count() or 1) // args.nproc)
    env = {**os.environ, ARGS_ENV: json.dumps(argv), "OMP_NUM_THREADS": str(threads)}
    return subprocess.run(cmd, env=env).returncode


def model_config(args: argparse.Namespace) -> ModelConfig:
    ffn = (8 * args.dim // 3 + 63) // 64 * 64  # SwiGLU's usual 8/3 x dim, rounded to 64
    return ModelConfig(name="bench", dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.heads,
                       ffn_dim=ffn, vocab_size=args.vocab, max_seq_len=64)


def build_trained_model(cfg: ModelConfig, world_size: int):
    """The model (FSDP2-sharded over every rank when there are several) and AdamW after one step (full state)."""
    torch.manual_seed(0)
    model = build_model(cfg, "meta")
    if world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    model.init_weights()
    optimizer = build_optimizer(model, OptimConfig(lr=1e-4), "cpu")
    tokens = torch.randint(0, cfg.vocab_size, (1, 17))
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def timed(fn) -> float:
    """Seconds until every rank has finished fn (the slowest rank decides, as in a real save)."""
    barrier()
    start = time.perf_counter()
    fn()
    barrier()
    return time.perf_counter() - start


def save_sync(root: Path, model, optimizer) -> dict:
    manager = CheckpointManager(root, keep_last=2, async_save=False)
    state = checkpoint_state.app_state(model, optimizer)
    seconds = timed(lambda: manager.save(1, state, checkpoint_state.rank_state(optimizer), {}))
    return {"sync_s": seconds, "bytes": manager.stats.bytes}


def save_async(root: Path, model, optimizer) -> dict:
    """save() returning is what the loop waits for; wait() right after: the time to commit with nothing competing."""
    manager = CheckpointManager(root, keep_last=2, async_save=True)
    barrier()
    start = time.perf_counter()
    manager.save(1, checkpoint_state.app_state(model, optimizer), checkpoint_state.rank_state(optimizer), {})
    returned = time.perf_counter()
    manager.wait()
    barrier()
    return {"async_blocking_s": returned - start, "async_total_s": time.perf_counter() - start}


def verify_time(root: Path) -> float:
    (path,) = [p for _, p in list_committed(root)]
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    problems: list[str] = []
    seconds = timed(lambda: problems.extend(verify(path, rank, world)))
    assert not problems, problems
    return seconds


def raw_write(path: Path, nbytes: int) -> None:
    """`dd if=/dev/zero of=path bs=4M count=... conv=fsync`: the data, then fsync, before returning."""
    count = max(1, -(-nbytes // BLOCK))
    if shutil.which("dd"):
        subprocess.run(["dd", "if=/dev/zero", f"of={path}", f"bs={BLOCK}", f"count={count}", "conv=fsync",
                        "status=none"], check=True)
        return
    block = bytes(BLOCK)
    with open(path, "wb") as f:
        for _ in range(count):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())


def raw_write_time(directory: Path, nbytes: int) -> float:
    """Every rank writes its share at once: as many writers as the checkpoint had."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    target = directory / f"dd-rank{rank}.bin"
    seconds = timed(lambda: raw_write(target, nbytes // world))
    target.unlink()
    return seconds


def one_repeat(base: Path, index: int, model, optimizer, is_main: bool) -> dict:
    work = base / f"repeat-{index}"
    if is_main:
        work.mkdir(parents=True)
    barrier()
    result = save_sync(work / "sync", model, optimizer)
    result["verify_s"] = verify_time(work / "sync")
    result.update(save_async(work / "async", model, optimizer))
    result["raw_write_s"] = raw_write_time(work, result["bytes"])
    barrier()
    if is_main:
        shutil.rmtree(work)
    return result


def summarize(runs: list[dict], params: int, world: int) -> dict:
    median = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    mib = median["bytes"] / 2**20
    return {
        "params": params,
        "ranks": world,
        "checkpoint_mib": mib,
        **{key: value for key, value in median.items() if key != "bytes"},
        "sync_mib_s": mib / median["sync_s"],
        "async_mib_s": mib / median["async_total_s"],
        "raw_write_mib_s": mib / median["raw_write_s"],
        "verify_mib_s": mib / median["verify_s"],
        "repeats": runs,
    }


def print_table(summary: dict) -> None:
    s = summary
    print(f"checkpoint: {s['params'] / 1e6:.1f}M params + AdamW = {s['checkpoint_mib']:.0f} MiB, {s['ranks']} rank(s), "
          f"median of {len(s['repeats'])}")
    rows = [
        ("sync save (committed)", s["sync_s"], s["sync_mib_s"]),
        ("async save: loop blocked", s["async_blocking_s"], None),
        ("async save: until committed", s["async_total_s"], s["async_mib_s"]),
        ("verify (sha256 of every file)", s["verify_s"], s["verify_mib_s"]),
        ("raw write, dd bs=4M conv=fsync", s["raw_write_s"], s["raw_write_mib_s"]),
    ]
    print(f"{'':34} {'seconds':>9} {'MiB/s':>9}")
    for name, seconds, rate in rows:
        print(f"{name:34} {seconds:9.3f} {'' if rate is None else f'{rate:9.0f}':>9}")


def main(argv: list[str]) -> int:
    if "LOCAL_RANK" in os.environ and ARGS_ENV in os.environ:
        argv = json.loads(os.environ[ARGS_ENV])
    args = parse_args(argv)
    if args.nproc > 1 and "LOCAL_RANK" not in os.environ:
        return relaunch_under_torchrun(args, argv)
    world = distributed.init_distributed(ClusterConfig())  # a gloo world of one outside torchrun
    try:
        cfg = model_config(args)
        model, optimizer = build_trained_model(cfg, world.world_size)
        run_id = os.getpid() if world.world_size == 1 else os.environ.get("TORCHELASTIC_RUN_ID", "x")
        base = args.dir.resolve() / f"run-{run_id}"
        runs = [one_repeat(base, i, model, optimizer, world.is_main) for i in range(args.repeats)]
        if world.is_main:
            shutil.rmtree(base, ignore_errors=True)
            if not any(args.dir.iterdir()):
                args.dir.rmdir()  # leave no empty directory behind under runs/
            summary = summarize(runs, count_params(build_model(cfg, "meta")), world.world_size)
            print_table(summary)
            if args.out:
                args.out.write_text(json.dumps(summary, indent=2) + "\n")
    finally:
        distributed.close_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
