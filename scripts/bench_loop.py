"""Tokens/s of trainctl's worker loop vs a bare PyTorch loop on the same model and batches.

Both loops train the same Llama (trainctl.models.llama) in one process, fp32, on the
same pre-generated synthetic batches, with AdamW and global-norm clipping; warmup
steps are excluded. The ratio trainctl / bare measures the loop's own overhead
(schedule, accumulation contexts, loss normalization, metrics); the target is >= 0.97.

    python scripts/bench_loop.py [--steps 30] [--warmup 5] [--repeats 3] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from trainctl.config.schema import ClusterConfig, LoggingConfig, ModelConfig, OptimConfig, RunConfig, ScheduleConfig, TrainConfig
from trainctl.models.llama import build_model
from trainctl.train import distributed as D
from trainctl.train.metrics import MetricsLogger
from trainctl.train.optim import build_optimizer
from trainctl.train.trainer import Job, train_loop

MODEL = ModelConfig(name="tiny")  # dim 256, 4 layers, byte vocabulary: the CPU demo model


class FixedBatches:
    """Stands in for TokenBatches: the same pre-generated micro-batches every step (no data cost in either loop)."""

    def __init__(self, batches):
        self._batches = batches

    def micro_batches(self, step):
        return self._batches

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


def time_trainctl(cfg: RunConfig, batches, world: D.World, warmup: int, steps: int, run_dir: Path) -> float:
    model = fresh_model(world.device)
    optimizer = build_optimizer(model, cfg.optim, world.device.type)
    data = FixedBatches(batches)
    metrics = MetricsLogger(run_dir, cfg.logging, steps, is_main=False, config={})

    def job_for(n: int) -> Job:
        return Job(replace(cfg, train=replace(cfg.train, steps=n)), world, model, optimizer, data, data, metrics, None)

    train_loop(job_for(warmup))
    start = time.perf_counter()
    train_loop(job_for(steps))
    _sync(world.device)
    return time.perf_counter() - start


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
    args = parser.parse_args()

    cfg = RunConfig(
        model=MODEL,
        cluster=ClusterConfig(device=args.device, cpu_threads=args.threads),
        optim=OptimConfig(grad_clip=1.0),
        schedule=ScheduleConfig(name="cosine", warmup_steps=2),
        train=TrainConfig(seq_len=args.seq_len, micro_batch=args.micro_batch, grad_accum=args.grad_accum,
                          global_batch=args.micro_batch * args.grad_accum, eval_every=0, eval_batches=0),
        logging=LoggingConfig(log_every=10, progress=False),
    )
    world = D.init_distributed(cfg.cluster)
    try:
        threads = D.set_cpu_threads(cfg.cluster, 1)
        generator = torch.Generator().manual_seed(0)
        tokens = [torch.randint(0, MODEL.vocab_size, (args.micro_batch, args.seq_len + 1), generator=generator)
                  for _ in range(args.grad_accum)]
        batches = [(t[:, :-1].contiguous().to(world.device), t[:, 1:].contiguous().to(world.device)) for t in tokens]
        step_tokens = args.micro_batch * args.grad_accum * args.seq_len * args.steps
        bare, ours = [], []
        with tempfile.TemporaryDirectory() as run_dir:
            runs = {
                "bare": lambda: bare.append(step_tokens / time_bare(cfg, batches, world.device, args.warmup, args.steps)),
                "ours": lambda: ours.append(step_tokens / time_trainctl(cfg, batches, world, args.warmup, args.steps, Path(run_dir))),
            }
            for repeat in range(args.repeats):
                # Interleaved, alternating which goes first: drift in machine speed hits both alike.
                for name in (("bare", "ours") if repeat % 2 == 0 else ("ours", "bare")):
                    runs[name]()
        print(f"device {world.device}, {threads} threads, model {MODEL.name}, batch {args.micro_batch}x{args.grad_accum}x{args.seq_len}, "
              f"{args.steps} steps after {args.warmup} warmup, {args.repeats} repeats")
        print(f"bare PyTorch loop : best {max(bare):8.0f}  median {statistics.median(bare):8.0f} tokens/s  (runs: {', '.join(f'{x:.0f}' for x in bare)})")
        print(f"trainctl loop     : best {max(ours):8.0f}  median {statistics.median(ours):8.0f} tokens/s  (runs: {', '.join(f'{x:.0f}' for x in ours)})")
        # Best-of is the least noise-sensitive estimate of a loop's own cost on a shared machine.
        print(f"ratio trainctl/bare: best {max(ours) / max(bare):.3f}, median {statistics.median(ours) / statistics.median(bare):.3f}  (target >= 0.97)")
    finally:
        D.close_distributed()


if __name__ == "__main__":
    main()
