"""Tokens/s of trainctl's training loop against a bare PyTorch loop: same model, init, batches, optimizer,
precision, activation checkpointing and compile settings, in one process, on any device.

    python scripts/bench_loop.py                                  # the tiny CPU model, fp32 (the CPU default)
    python scripts/bench_loop.py --recipe llama1b_bench --device cuda --steps 40 --warmup 10   # 1B, bf16, compiled
    python scripts/bench_loop.py --recipe tiny_cpu train.seq_len=128 precision=bf16 --json out.json

trainctl's arm is the worker itself: `job_setup.setup` builds the Job from the composed recipe (one process,
no checkpoints, no evaluation; its batches swapped for the pre-generated ones) and `trainer.train_loop` runs
warmup + timed steps. Its time is what the loop's own timer logs (metrics.jsonl, one record every `warmup`
steps, synchronized on CUDA) for the steps after warmup, so one-off work of the first steps (compilation,
the step whose peak memory is measured) stays out, while what recurs (logging, the guard's all-reduce, GC)
stays in. The bare arm is what a hand-written single-device loop does: the same Llama built the same way
(float8 conversion, checkpointing and per-block compile with the same settings), torch.autocast in the
compute dtype over fp32 weights, dense cross-entropy, global-norm clipping, the same AdamW; timed with CUDA
events (perf_counter on CPU). Rounds alternate which arm goes first so drift hits both alike. The target
ratio trainctl/bare is >= 0.97.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from trainctl.config.compose import compose
from trainctl.config.errors import ConfigError
from trainctl.config.schema import CheckpointConfig, DataConfig, RunConfig
from trainctl.config.validate import resolve
from trainctl.models.build import build_model
from trainctl.models.common.attention import attention_backends
from trainctl.train.loop.job_setup import setup
from trainctl.train.loop.stop import StopRequest
from trainctl.train.loop.trainer import train_loop
from trainctl.train.optim import build_optimizer
from trainctl.train.parallel import distributed
from trainctl.train.parallel.activations import apply_activation_checkpointing
from trainctl.train.parallel.float8 import apply_float8
from trainctl.train.parallel.parallelize import apply_compile
from trainctl.train.parallel.precision import DTYPES

CPU_DEFAULT = ["recipe=tiny_cpu", "sharding=none", "train.seq_len=256", "train.micro_batch=8", "train.grad_accum=1"]


class FixedBatches:
    """Stands in for TokenBatches: the same pre-generated micro-batches every step (no data cost in either arm)."""

    masked = False  # every target counts (synthetic tokens): no per-step count of loss tokens

    def __init__(self, batches, ramp):
        self._batches = batches
        self.ramp = ramp  # the run's batch per step (train.batch_ramp): the loop's lr and metrics read it

    def micro_batches(self, step):
        return self._batches

    def first_sample(self, step):
        return 0

    def eval_batches(self, n):
        return []


class Clock:
    """Elapsed seconds of a span of device work: CUDA events on GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self._end.record()
            self._end.synchronize()
            self.seconds = self._start.elapsed_time(self._end) / 1000
        else:
            self.seconds = time.perf_counter() - self._t0


def bench_config(recipe_overrides: list[str], device: str, warmup: int, steps: int) -> RunConfig:
    """The recipe for one process on `device`: synthetic tokens, no evaluation, no checkpoints, quiet logging."""
    cfg = compose([*recipe_overrides, "cluster.nodes=1", "cluster.procs_per_node=1", f"cluster.device={device}"])
    cfg = resolve(replace(
        cfg,
        data=DataConfig(kind="synthetic", vocab_size=cfg.model.vocab_size),
        schedule=replace(cfg.schedule, warmup_steps=min(cfg.schedule.warmup_steps, warmup)),
        train=replace(cfg.train, steps=warmup + steps, eval_every=0, eval_batches=0, global_batch=-1),
        checkpoint=CheckpointConfig(every=0, save_final=False, resume="never"),
        logging=replace(cfg.logging, log_every=warmup, progress=False, wandb=replace(cfg.logging.wandb,
                                                                                     mode="disabled")),
    ))
    return cfg


def bare_model(cfg: RunConfig, device: torch.device) -> torch.nn.Module:
    """The Llama as a single-device user builds it, with the run's float8, checkpointing and compile settings."""
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, "meta")
    apply_float8(model, cfg.precision, fsdp=False)
    apply_activation_checkpointing(model, cfg.train.activation_checkpointing, cfg.train.ac_every)
    if cfg.train.compile:
        apply_compile(model)
    model.to_empty(device=device)
    model.init_weights()
    return model


def bare_steps(model, optimizer, batches, steps: int, cfg: RunConfig, device: torch.device) -> None:
    """Forward under autocast, dense loss over the step's tokens, backward, clip, AdamW step."""
    dtype = DTYPES[cfg.precision.compute_dtype]
    tokens = sum(targets.numel() for _, targets in batches)
    for _ in range(steps):
        for inputs, targets in batches:
            with torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else nullcontext():
                logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum") / tokens
            loss.backward()
        if cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def time_bare(cfg: RunConfig, batches, device: torch.device, warmup: int, steps: int) -> float:
    """Seconds of `steps` bare steps after `warmup` of them."""
    model = bare_model(cfg, device)
    optimizer = build_optimizer(model, cfg.optim, device.type)
    bare_steps(model, optimizer, batches, warmup, cfg, device)
    with Clock(device) as clock:
        bare_steps(model, optimizer, batches, steps, cfg, device)
    return clock.seconds


def time_trainctl(cfg: RunConfig, batches, world: distributed.World, warmup: int, run_dir: Path) -> float:
    """Seconds of the steps after warmup, as trainctl's own loop timed and logged them."""
    run_dir.mkdir(parents=True)
    job = setup(cfg, run_dir, world, StopRequest())
    data = FixedBatches(batches, job.train_data.ramp)
    job = replace(job, train_data=data, val_data=data)
    try:
        train_loop(job)
    finally:
        job.metrics.close()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if r.get("kind") == "train" and r["step"] > warmup]
    return sum(r["step_time_s"] * warmup for r in timed)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="config overrides, as for `trainctl launch` (key=value)")
    parser.add_argument("--recipe", default=None, help="a recipe (default: tiny_cpu at 8 x 256 tokens, fp32)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per round (rounded up to warmup's multiple)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    steps = math.ceil(args.steps / args.warmup) * args.warmup
    overrides = [f"recipe={args.recipe}", *args.overrides] if args.recipe else [*CPU_DEFAULT, *args.overrides]
    cfg = bench_config(overrides, args.device, args.warmup, steps)
    world = distributed.init_distributed(cfg.cluster)
    try:
        with attention_backends():
            result = run_rounds(cfg, world, args.warmup, steps, args.rounds)
    finally:
        distributed.close_distributed()
    report(result, args.json)
    return result


def run_rounds(cfg: RunConfig, world: distributed.World, warmup: int, steps: int, rounds: int) -> dict:
    threads = distributed.set_cpu_threads(cfg.cluster, 1)
    t = cfg.train
    generator = torch.Generator().manual_seed(t.seed)
    batches = []
    for _ in range(t.grad_accum):
        tokens = torch.randint(0, cfg.model.vocab_size, (t.micro_batch, t.seq_len + 1), generator=generator)
        batches.append((tokens[:, :-1].contiguous().to(world.device), tokens[:, 1:].contiguous().to(world.device)))
    step_tokens = t.micro_batch * t.grad_accum * t.seq_len
    bare, ours = [], []
    with tempfile.TemporaryDirectory() as tmp:
        arms = {
            "bare": lambda: bare.append(steps * step_tokens / time_bare(cfg, batches, world.device, warmup, steps)),
            "trainctl": lambda: ours.append(steps * step_tokens / time_trainctl(
                cfg, batches, world, warmup, Path(tmp) / f"run-{len(ours)}")),
        }
        for index in range(rounds):
            for name in ("bare", "trainctl") if index % 2 == 0 else ("trainctl", "bare"):
                arms[name]()
                if world.device.type == "cuda":
                    torch.cuda.empty_cache()
    return {
        "device": torch.cuda.get_device_name(world.device) if world.device.type == "cuda" else "cpu",
        "torch": torch.__version__, "threads": threads, "recipe": cfg.recipe, "model": cfg.model.name,
        "precision": cfg.precision.compute_dtype, "fp8": cfg.precision.fp8, "compile": t.compile,
        "activation_checkpointing": t.activation_checkpointing,
        "batch": f"{t.micro_batch}x{t.grad_accum}x{t.seq_len}", "warmup": warmup, "steps": steps,
        "bare_tokens_per_s": bare, "trainctl_tokens_per_s": ours,
        # Best-of is the least noise-sensitive estimate of a loop's own cost on a shared machine.
        "ratio_best": max(ours) / max(bare), "ratio_median": statistics.median(ours) / statistics.median(bare),
    }


def report(result: dict, json_path: Path | None) -> None:
    """The table on stdout; with --json, the same numbers as JSON."""
    print(f"device {result['device']} (torch {result['torch']}, {result['threads']} threads), recipe "
          f"{result['recipe']}, model {result['model']}, {result['precision']}{' fp8' if result['fp8'] else ''}, "
          f"compile {result['compile']}, AC {result['activation_checkpointing']}, batch {result['batch']}, "
          f"{result['steps']} timed steps after {result['warmup']} per round")
    for label, key in (("bare PyTorch loop", "bare_tokens_per_s"), ("trainctl loop    ", "trainctl_tokens_per_s")):
        values = result[key]
        runs = ", ".join(f"{x:.0f}" for x in values)
        print(f"{label}: best {max(values):10.0f}  median {statistics.median(values):10.0f} tokens/s  (rounds: {runs})")
    print(f"ratio trainctl/bare: best {result['ratio_best']:.3f}, median {result['ratio_median']:.3f}  "
          "(target >= 0.97)")
    if json_path:
        json_path.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    try:
        main()
    except ConfigError as err:
        raise SystemExit(f"bench_loop: {err}") from None
