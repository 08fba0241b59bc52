"""Tokens/s of trainctl's worker loop vs a bare PyTorch loop on the same model and batches.

Both loops train the same Llama (trainctl.models.llama) in one process, fp32, on the
same pre-generated synthetic batches, with AdamW and global-norm clipping; warmup
steps are excluded. trainctl's side is the worker's own: `trainer.setup` builds the Job
from a run directory (synthetic data, no checkpoints), whose batches are then swapped for the
pre-generated ones, and `trainer.train_loop` runs it. The ratio trainctl / bare measures the
loop's own overhead (schedule, accumulation contexts, loss normalization, guard, metrics);
the target is >= 0.97.

    python scripts/bench_loop.py [--steps 30] [--warmup 5] [--repeats 3] [--device cpu] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from trainctl.config.schema import (
    CheckpointConfig,
    ClusterConfig,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    ScheduleConfig,
    TrainConfig,
)
from trainctl.models.llama import build_model
from trainctl.train import distributed
from trainctl.train.optim import build_optimizer
from trainctl.train.stop import StopRequest
from trainctl.train.trainer import setup, train_loop

MODEL = ModelConfig(name="tiny")  # dim 256, 4 layers, byte vocabulary: the CPU demo model


class FixedBatches:
    """Stands in for TokenBatches: the same pre-generated micro-batches every step (no data cost in either loop)."""

    def __init__(self, batches):
        self._batches = batches

    def micro_batches(self, step):
        return self._batches

    def first_sample(self, step):
        return 0

    def eval_batches(self, n):
        return []


def fresh_model(device: torch.device):
    torch.manual_seed(0)
    model = build_model(MODEL, "meta")
    model.to_empty(device=device)
    model.init_weights()
    return model


def bare_loop(model, optimizer, batches, steps: int, grad_clip: float) -> None:
    """What a hand-written loop does: forward, mean loss, backward, clip, step."""
    for _ in range(steps):
        for inputs, targets in batches:
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten()) / len(batches)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def time_bare(cfg: RunConfig, batches, device, warmup: int, steps: int) -> float:
    model = fresh_model(device)
    optimizer = build_optimizer(model, cfg.optim, device.type)
    bare_loop(model, optimizer, batches, warmup, cfg.optim.grad_clip)
    start = time.perf_counter()
    bare_loop(model, optimizer, batches, steps, cfg.optim.grad_clip)
    _sync(device)
    return time.perf_counter() - start


def time_trainctl(cfg: RunConfig, batches, world: distributed.World, warmup: int, steps: int, run_dir: Path) -> float:
    """The worker's setup and loop: `warmup` steps, then `steps` more timed (the same model and optimizer)."""
    run_dir.mkdir(parents=True)
    job = setup(replace(cfg, train=replace(cfg.train, steps=warmup)), run_dir, world, StopRequest())
    data = FixedBatches(batches)
    job = replace(job, train_data=data, val_data=data)
    try:
        train_loop(job)
        job = replace(job, cfg=replace(cfg, train=replace(cfg.train, steps=warmup + steps)))
        start = time.perf_counter()
        train_loop(job)
        _sync(world.device)
        return time.perf_counter() - start
    finally:
        job.metrics.close()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0: all cores")
    parser.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    args = parser.parse_args()

    cfg = RunConfig(
        model=MODEL,
        cluster=ClusterConfig(device=args.device, cpu_threads=args.threads),
        optim=OptimConfig(grad_clip=1.0),
        schedule=ScheduleConfig(name="cosine", warmup_steps=2),
        data=DataConfig(kind="synthetic", vocab_size=MODEL.vocab_size),
        train=TrainConfig(seq_len=args.seq_len, micro_batch=args.micro_batch, grad_accum=args.grad_accum,
                          global_batch=args.micro_batch * args.grad_accum, eval_every=0, eval_batches=0),
        checkpoint=CheckpointConfig(every=0, save_final=False, resume="never"),
        logging=LoggingConfig(log_every=10, progress=False),
    )
    world = distributed.init_distributed(cfg.cluster)
    try:
        threads = distributed.set_cpu_threads(cfg.cluster, 1)
        generator = torch.Generator().manual_seed(0)
        tokens = [torch.randint(0, MODEL.vocab_size, (args.micro_batch, args.seq_len + 1), generator=generator)
                  for _ in range(args.grad_accum)]
        batches = [(t[:, :-1].contiguous().to(world.device), t[:, 1:].contiguous().to(world.device)) for t in tokens]
        step_tokens = args.micro_batch * args.grad_accum * args.seq_len * args.steps
        bare, ours = [], []
        with tempfile.TemporaryDirectory() as tmp:
            runs = {
                "bare": lambda: bare.append(step_tokens / time_bare(cfg, batches, world.device, args.warmup,
                                                                   args.steps)),
                "ours": lambda: ours.append(step_tokens / time_trainctl(cfg, batches, world, args.warmup, args.steps,
                                                                       Path(tmp) / f"run-{len(ours)}")),
            }
            for repeat in range(args.repeats):
                # Interleaved, alternating which goes first: drift in machine speed hits both alike.
                for name in (("bare", "ours") if repeat % 2 == 0 else ("ours", "bare")):
                    runs[name]()
        report(args, world, threads, bare, ours)
    finally:
        distributed.close_distributed()


def report(args: argparse.Namespace, world: distributed.World, threads: int, bare: list[float], ours: list[float]):
    """The table on stdout; with --json, the same numbers as JSON."""
    batch = f"{args.micro_batch}x{args.grad_accum}x{args.seq_len}"
    print(f"device {world.device}, {threads} threads, model {MODEL.name}, batch {batch}, "
          f"{args.steps} steps after {args.warmup} warmup, {args.repeats} repeats")
    for label, values in (("bare PyTorch loop ", bare), ("trainctl loop     ", ours)):
        runs = ", ".join(f"{x:.0f}" for x in values)
        print(f"{label}: best {max(values):8.0f}  median {statistics.median(values):8.0f} tokens/s  (runs: {runs})")
    # Best-of is the least noise-sensitive estimate of a loop's own cost on a shared machine.
    best, median = max(ours) / max(bare), statistics.median(ours) / statistics.median(bare)
    print(f"ratio trainctl/bare: best {best:.3f}, median {median:.3f}  (target >= 0.97)")
    if args.json:
        results = {"device": str(world.device), "threads": threads, "steps": args.steps, "warmup": args.warmup,
                   "bare_tokens_per_s": bare, "trainctl_tokens_per_s": ours, "ratio_best": best, "ratio_median": median}
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
