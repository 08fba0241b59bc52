"""The run plan: what a resolved config will do, computed before anything starts.

Pure functions of the config (no I/O, no torch). `build` expects the config the
validate step resolved: concrete batch sizes and parallel degrees.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trainctl.config import hf_config
from trainctl.config.data_check import data_file_problems, epochs_of
from trainctl.config.schema import CheckpointConfig, ClusterConfig, ModelConfig, RunConfig, ShardingConfig, TrainConfig
from trainctl.core import hub, lora
from trainctl.core.batch_ramp import BatchRamp
from trainctl.core.dims import ParallelDims, UnresolvedDims
from trainctl.core.errors import UserError
from trainctl.core.gpus import GPUS
from trainctl.core.support import unsupported
from trainctl.core.wrapping import wrapping
from trainctl.plan import advice, fit, memory
from trainctl.plan.assess import Assessment, assess
from trainctl.plan.experts import ExpertShare, expert_share
from trainctl.plan.flops import flops_per_token, lora_formula_count, lora_shapes, param_count, trainable_count
from trainctl.plan.stages import rank_stages
from trainctl.plan.throughput import StepTime, attention_flops_causal, hours
from trainctl.plan.transients import DTYPE_BYTES


class PlanError(UserError):
    """The config given to `build` was not resolved by validate; the message is one line."""


@dataclass(frozen=True)
class BatchMath:
    global_batch: int  # sequences per optimizer step
    micro_batch: int  # sequences per rank per forward
    grad_accum: int  # micro-batches per optimizer step
    dp: int  # data-parallel degree
    seq_len: int
    tokens_per_step: int
    tokens_total: int  # over train.steps (a batch ramp's smaller steps counted as they are)
    # train.batch_ramp's stages (steps, global_batch, grad_accum, tokens), the full batch last; [] without a ramp
    ramp: list = dataclasses.field(default_factory=list)


@dataclass(frozen=True)
class RunPlan:
    world_size: int
    nodes: int
    procs_per_node: int
    strategy: str
    model: str  # the architecture the worker builds: family (Hugging Face model_type) and shape
    dims: ParallelDims
    batch: BatchMath
    params_total: int  # every parameter the worker builds: the model's, plus model.lora's adapters
    params_trainable: int  # what the optimizer steps: model.lora's adapters (rank x (in + out) per target), or all
    params_per_mp_rank: int  # parameters of the busiest tensor x pipeline rank (norms replicated over tp)
    flops_per_token: float  # model FLOPs, forward + backward (attention over the full sequence, as MFU counts it)
    attention_flops_causal: float  # per token: what causal attention kernels execute (half the full-sequence term)
    flops_per_step: float
    memory: memory.RankMemory  # the busiest rank
    memory_per_pp_rank: tuple[memory.RankMemory, ...]
    fit: fit.Fit  # the busiest rank's verdict
    fits_per_pp_rank: tuple[fit.Fit, ...]
    device: str  # cpu | cuda
    gpu: str  # key of hardware.GPUS, "" when unknown
    peak_flops_per_device: float | None  # dense peak for the compute dtype; None when unknown
    assumed_mfu: float
    step_time: StepTime | None  # at assumed_mfu (throughput.py); None without a peak
    notes: tuple[str, ...]  # where the worker differs from the textbook, for this config
    advice: tuple[advice.Suggestion, ...]  # when a rank does not fit or is tight
    warnings: tuple[str, ...]
    # the busiest rank's routed experts and all-to-all (plan/experts.py); None for a dense model
    experts: ExpertShare | None = None

    @property
    def step_time_s(self) -> float | None:
        return None if self.step_time is None else self.step_time.total_s

    def throughput(self) -> dict:
        step = self.step_time_s
        total = None if step is None else step * self.batch.tokens_total / self.batch.tokens_per_step
        return {
            "flops_per_token": self.flops_per_token,
            "attention_flops_causal_per_token": self.attention_flops_causal,
            "flops_per_step": self.flops_per_step,
            "peak_flops_per_device": self.peak_flops_per_device,
            "assumed_mfu": self.assumed_mfu,
            "step_time_s": step,
            "step_time": None if self.step_time is None else self.step_time.to_dict(),
            "tokens_per_s": None if not step else self.batch.tokens_per_step / step,
            "time_to_tokens_s": total,
            "time_to_tokens_h": hours(total),
            "gpu_hours": None if total is None or self.device != "cuda" else hours(total) * self.world_size,
        }

    def memory_dict(self) -> dict:
        pairs = zip(self.memory_per_pp_rank, self.fits_per_pp_rank, strict=True)
        per_rank = [{**rank_memory.to_dict(), **rank_fit.to_dict()} for rank_memory, rank_fit in pairs]
        return {**self.memory.to_dict(), **self.fit.to_dict(), "per_pp_rank": per_rank}

    def to_dict(self) -> dict:
        """Plain JSON-serializable data (launch writes it to RUN_DIR/plan.json, with the launch command)."""
        skip = ("memory_per_pp_rank", "fits_per_pp_rank", "fit", "step_time", "attention_flops_causal")
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}
        degrees = self.dims.as_dict()  # ep (a split of dp_shard, not a factor of the world) shown beside it
        data["dims"] = {"dp_replicate": degrees.pop("dp_replicate"), "dp_shard": degrees.pop("dp_shard"),
                        "ep": self.dims.ep, **degrees, "dp": self.dims.dp}
        data["batch"] = dataclasses.asdict(self.batch)
        data["memory"] = self.memory_dict()
        data["throughput"] = self.throughput()
        data["step_time_s"] = self.step_time_s
        data["notes"] = list(self.notes)
        data["advice"] = [a.to_dict() for a in self.advice]
        data["warnings"] = list(self.warnings)
        data["experts"] = None if self.experts is None else self.experts.to_dict()
        return data


def model_label(m: ModelConfig) -> str:
    """What the worker builds, in one line: `qwen2 (name): 24 layers x 896, 14/2 heads, vocab 151936`."""
    named = f" ({m.name})" if m.name and m.name != m.family else ""
    lora = f", LoRA rank {m.lora.rank} on {','.join(m.lora.targets)}" if m.lora.rank > 0 else ""
    lora += " (4-bit NF4 base)" if lora and m.lora.base_dtype == "nf4" else ""
    return (f"{m.family}{named}: {m.n_layers} layers x {m.dim}, {m.n_heads}/{m.n_kv_heads} heads, "
            f"vocab {m.vocab_size}{lora}")


def world_size(cluster: ClusterConfig) -> int:
    return cluster.nodes * cluster.procs_per_node


def resolved_dims(sharding: ShardingConfig, world: int) -> ParallelDims:
    """ParallelDims from already-resolved degrees; PlanError if any is unresolved or they don't cover the world."""
    try:
        return ParallelDims.from_config(sharding, world)
    except UnresolvedDims as exc:
        raise PlanError(str(exc)) from None


def batch_math(train: TrainConfig, dp: int) -> BatchMath:
    """Tokens per step and in total; PlanError if the batch sizes are unresolved."""
    sizes = {"global_batch": train.global_batch, "micro_batch": train.micro_batch, "grad_accum": train.grad_accum}
    unresolved = [f"train.{k}={v}" for k, v in sizes.items() if v < 1]
    if unresolved:
        raise PlanError(f"{', '.join(unresolved)}: the plan needs resolved batch sizes; run the config through "
                        "validate first")
    tokens_per_step = train.tokens_per_step
    ramp = BatchRamp.of(train, dp)
    return BatchMath(
        global_batch=train.global_batch,
        micro_batch=train.micro_batch,
        grad_accum=train.grad_accum,
        dp=dp,
        seq_len=train.seq_len,
        tokens_per_step=tokens_per_step,
        tokens_total=ramp.total_sequences * train.seq_len,
        ramp=ramp.stage_records(train.seq_len) if ramp.enabled else [],
    )


def batch_warning(batch: BatchMath) -> str | None:
    expected = batch.micro_batch * batch.grad_accum * batch.dp
    if batch.global_batch == expected:
        return None
    return (
        f"train.global_batch={batch.global_batch} is not micro_batch x grad_accum x dp "
        f"= {batch.micro_batch} x {batch.grad_accum} x {batch.dp} = {expected}"
    )


def gpu_warning(cluster: ClusterConfig) -> str | None:
    if cluster.device != "cuda" or cluster.gpu in GPUS:
        return None
    return (f"cluster.gpu={cluster.gpu!r} is not a known GPU ({', '.join(GPUS)}): "
            "no memory check and no step-time estimate")


def fit_warning(a: Assessment, device: str) -> str | None:
    """One line when the busiest rank does not fit (or is tight), naming the top advice."""
    f, mem = a.fit, a.memory
    if f.verdict not in ("does not fit", "tight") or f.capacity_bytes is None:
        return None
    GIB = memory.GIB
    where = f"pp rank {mem.pp_rank}" if len(a.per_pp_rank) > 1 else "each rank"
    return (f"{where} needs {f.need_bytes / GIB:.1f} GiB (peak {f.peak_bytes / GIB:.1f} GiB at the {mem.peak_phase} "
            "phase + "
            f"{f.framework_bytes / GIB:.1f} GiB framework) of the {f.capacity_bytes / GIB:.1f} GiB of one "
            f"{device}: {f.verdict}")


def refusal(plan: RunPlan) -> str | None:
    """The one line `launch` refuses with when the busiest rank does not fit; None when it may go ahead."""
    if fit.fits(plan.fit):
        return None
    f, gib = plan.fit, memory.GIB
    where = f"pp rank {plan.memory.pp_rank}" if len(plan.memory_per_pp_rank) > 1 else "each rank"
    top = next((a for a in plan.advice if a.verdict in ("fits", "tight")), None)
    hint = "" if top is None else (f"; try {' '.join(top.overrides)} ({top.need_bytes / gib:.1f} GiB"
                                   + ("" if top.slowdown is None else f", {top.slowdown:+.0%} step time") + ")")
    return (f"does not fit: {where} needs {f.need_bytes / gib:.1f} GiB (peak {f.peak_bytes / gib:.1f} GiB + "
            f"{f.framework_bytes / gib:.1f} GiB framework) of the {f.capacity_bytes / gib:.1f} GiB of one "
            f"{fit.device_label(plan.device, plan.gpu)}"
            f"{hint}; see `trainctl plan` for the breakdown, or pass --force")


def epochs_warning(cfg: RunConfig) -> str | None:
    """More than one pass over data.datasets: the same tokens come back (said, not refused)."""
    epochs = epochs_of(cfg.data, cfg.train)
    if epochs is None or epochs <= 1:
        return None
    return (f"data.datasets: {cfg.train.steps} steps read about {epochs:.1f} epochs of the training tokens; "
            "add data or lower train.steps for a single pass")


def weights_warning(model: ModelConfig, checkpoint: CheckpointConfig) -> str | None:
    """model.path names a folder with weights, and nothing loads them: the run would start from random weights of
    that shape (said, not refused: a from-scratch run of a published shape is a real use)."""
    if not model.path or checkpoint.init_from or checkpoint.resume not in ("auto", "never"):
        return None
    try:
        hf_config.weight_files(model.path)
    except hf_config.HFConfigError:
        return None  # a config.json alone: only a shape was ever meant
    pinned = hub.pin(model.path)
    name = pinned["name"] if pinned else model.path
    return (f"model.path={name}: takes the model's shape, not its weights: the run starts from random weights; "
            f"add checkpoint.init_from={name} to train from them")


def build(cfg: RunConfig, with_advice: bool = True, machine: fit.Machine | None = None) -> RunPlan:
    """The plan of a resolved config (the launch command is launch's: launch.command.plan_record).

    A local launch's devices are compared with `machine` (default: this one, fit.this_machine).
    """
    world = world_size(cfg.cluster)
    dims = resolved_dims(cfg.sharding, world)
    batch = batch_math(cfg.train, dims.dp)
    per_token = flops_per_token(cfg.model, cfg.train.seq_len)
    a = assess(cfg, dims)
    suggestions = advice.suggest(cfg, a) if with_advice and a.fit.verdict in ("does not fit", "tight") else []
    local = cfg.cluster.on_this_machine
    device = fit.device_warning(cfg.cluster, machine or fit.this_machine()) if local else None
    warnings = [batch_warning(batch), gpu_warning(cfg.cluster), device, *unsupported(cfg.sharding, cfg.precision),
                fit_warning(a, fit.device_label(cfg.cluster.device, cfg.cluster.gpu))]
    # The token files, by size and a bounded sample (launch refuses what this warns about).
    warnings += data_file_problems(cfg.data, cfg.data.vocab_size or cfg.model.vocab_size, cfg.train.seq_len)
    warnings += [epochs_warning(cfg), weights_warning(cfg.model, cfg.checkpoint), *lora_warnings(cfg)]
    return RunPlan(
        world_size=world,
        nodes=cfg.cluster.nodes,
        procs_per_node=cfg.cluster.procs_per_node,
        strategy=cfg.sharding.strategy,
        model=model_label(cfg.model),
        dims=dims,
        batch=batch,
        params_total=param_count(cfg.model) + (lora_formula_count(cfg.model) if cfg.model.lora.rank > 0 else 0),
        params_trainable=trainable_count(cfg.model),
        params_per_mp_rank=max(m.local_params for m in a.per_pp_rank),
        flops_per_token=per_token,
        attention_flops_causal=attention_flops_causal(cfg.model, cfg.train.seq_len),
        flops_per_step=per_token * batch.tokens_per_step,
        memory=a.memory,
        memory_per_pp_rank=a.per_pp_rank,
        fit=a.fit,
        fits_per_pp_rank=a.fits,
        device=cfg.cluster.device,
        gpu=cfg.cluster.gpu,
        peak_flops_per_device=a.peak_flops,
        assumed_mfu=a.assumed_mfu,
        step_time=a.step,
        notes=a.notes,
        advice=tuple(suggestions),
        warnings=tuple(w for w in warnings if w),
        experts=experts_of(cfg, dims, a),
    )


def experts_of(cfg: RunConfig, dims: ParallelDims, a: Assessment) -> ExpertShare | None:
    """The busiest rank's routed experts under the config's ep x FSDP2 split (None for a dense model)."""
    t = cfg.train
    layers = len(rank_stages(cfg.model, cfg.sharding, t.grad_accum)[a.busiest].layers)
    return expert_share(cfg.model, dims, wrapping(cfg.sharding.strategy, dims, cfg.precision), layers,
                        a.memory.tokens_per_micro_batch, DTYPE_BYTES[cfg.precision.compute_dtype], t.grad_accum,
                        t.activation_checkpointing == "full", cfg.optim)


def lora_warnings(cfg: RunConfig) -> list[str]:
    """Adapters larger than what they adapt, and adapters trained on a frozen base that is random numbers."""
    if not lora.enabled(cfg.model.lora):
        return []
    found = [lora.oversized(cfg.model.lora, lora_shapes(cfg.model))]
    ck = cfg.checkpoint
    if not (cfg.model.path or ck.init_from or ck.resume not in ("auto", "never")):
        found.append(f"model.lora.rank={cfg.model.lora.rank} on a random base: no checkpoint.init_from (or "
                     "model.path) gives the frozen weights, so the adapters learn around noise and their export fits "
                     "no published model; set checkpoint.init_from=HF_MODEL_DIR")
    return [w for w in found if w]
