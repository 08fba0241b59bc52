"""Cross-field validation and resolution of a composed RunConfig.

`resolve(cfg)` checks everything that can be checked before launch, collects every
problem (one line each: the key, the value, why, what would work) and raises one
`ConfigError`; on success it returns the config with every derived value filled
in (parallel degrees, batch math), which is what the worker receives.
"""

from __future__ import annotations

import dataclasses
import math
import re

from trainctl.config import hf_config, hf_tensors, schema
from trainctl.config.data_check import datasets_problems, document_mask_problems, model_tokenizer_problems
from trainctl.config.errors import ConfigError
from trainctl.config.fields import declared_problems
from trainctl.config.objective_check import objective_problems
from trainctl.config.resume_source import check_resume_optimizer
from trainctl.config.schema import MAX_SEED  # noqa: F401 (tests import it from here)
from trainctl.core import batch_ramp, hub, lora, optimizers
from trainctl.core.dims import ParallelDims, degree_problems, degrees_of, infer_degrees
from trainctl.core.gpus import GPUS
from trainctl.core.support import lora_unsupported
from trainctl.core.wrapping import REPLICATING, SHARDING_WITHIN_GROUP, canonical, shards_parameters, wrapping
from trainctl.models import registry


def resolve(cfg: schema.RunConfig) -> schema.RunConfig:
    """Validate `cfg` and fill in derived values; raises ConfigError listing every problem."""
    cfg, hub_problems = resolve_hub_names(cfg)
    model, hf_problems = resolve_hf_model(cfg.model) if not hub_problems else (cfg.model, [])
    if hub_problems or hf_problems:
        raise ConfigError(hub_problems + hf_problems)
    # A blank runs_dir (an empty or blank $TRAINCTL_RUNS_DIR) means the default, as `runs` reads it.
    cfg = dataclasses.replace(cfg, model=model, runs_dir=cfg.runs_dir.strip() or "runs")
    nonfinite = check_finite(cfg) + check_init_from(cfg.checkpoint, cfg.model)
    model_problems = check_model(cfg.model, cfg.train)
    problems = declared_problems(cfg) + check_ranges(cfg) + model_problems
    problems += check_data(cfg.data, cfg.model) + check_cluster(cfg.cluster, cfg.precision) + cfg.cluster.problems()
    problems += check_names(cfg) + check_offload(cfg.sharding) + check_resume_optimizer(cfg.checkpoint, cfg.optim)
    problems += lora.problems(cfg.model.lora) + check_optim_keys(cfg.optim) + check_optim_model(cfg.optim, cfg.model)
    if not model_problems and not declared_problems(cfg.model, "model"):  # the shapes mean something
        problems += lora.width_problems(cfg.model.lora, registry.spec(cfg.model.family).linear_shapes(cfg.model))
    # Without a positive world size the degrees and the batch math mean nothing (and divide by it).
    dims = None
    if cfg.cluster.nodes >= 1 and cfg.cluster.procs_per_node >= 1:
        dims, topo_problems = infer_dims(cfg.sharding, world_size(cfg.cluster))
        problems += topo_problems
    if dims is not None:
        problems += check_model_parallel(dims, cfg.model)
        resolved = dataclasses.replace(cfg.sharding, **dims.as_dict())
        problems += lora_unsupported(cfg.model.lora, resolved, cfg.precision)
        problems += optimizers.unsupported(cfg.optim.name, wrapping(cfg.sharding.strategy, dims), dims.tp)
        train, batch_problems = resolve_batch(cfg.train, dims.dp)
        problems += batch_problems
        problems += check_pipeline(cfg.sharding, dims, cfg.model, train)
        problems += [] if batch_problems else batch_ramp.problems(train, dims.dp, dims.pp, cfg.schedule.warmup_steps)
        problems += check_context_parallel(dims, cfg.cluster, train)
        problems += datasets_problems(cfg.data, cfg.model.vocab_size, train)
        problems += document_mask_problems(cfg.data, dims.pp, dims.cp)
        problems += objective_problems(train, cfg.data, cfg.model.lora, cfg.checkpoint, resolved)
        problems += model_tokenizer_problems(cfg.data, cfg.checkpoint.init_from or cfg.model.path)
    problems = nonfinite + _without_keys(problems, nonfinite)
    if problems:
        raise ConfigError(problems)
    assert dims is not None  # a world size below 1 is a range problem above
    # The alias (fsdp) is resolved here, once: downstream code sees only the strategy it names.
    sharding = dataclasses.replace(cfg.sharding, strategy=canonical(cfg.sharding.strategy), **dims.as_dict())
    return dataclasses.replace(cfg, sharding=sharding, train=train, data=resolve_data_vocab(cfg.data, cfg.model))


def resolve_hub_names(cfg: schema.RunConfig) -> tuple[schema.RunConfig, list[str]]:
    """model.path and checkpoint.init_from given as a Hub name (org/name): its cached snapshot folder, whose path
    names the commit (the revision the run is pinned to)."""
    problems, found = [], {}
    for key, value in (("model.path", cfg.model.path), ("checkpoint.init_from", cfg.checkpoint.init_from)):
        try:
            found[key] = hub.resolve(value)
        except hub.HubError as exc:
            problems.append(f"{key}={exc}")
    if problems:
        return cfg, problems
    model = dataclasses.replace(cfg.model, path=found["model.path"])
    checkpoint = dataclasses.replace(cfg.checkpoint, init_from=found["checkpoint.init_from"])
    return dataclasses.replace(cfg, model=model, checkpoint=checkpoint), []


def resolve_hf_model(m: schema.ModelConfig) -> tuple[schema.ModelConfig, list[str]]:
    """model.path: the family and shape of that Hugging Face model, from its config.json (they replace the option's)."""
    if not m.path:
        if m.name == "hf":
            return m, ["model=hf: set model.path=DIR, a Hugging Face model folder (config.json, *.safetensors), "
                       "or a Hub name such as meta-llama/Llama-3.2-1B"]
        return m, []
    try:
        fields = hf_config.model_fields(m.path)
    except hf_config.HFConfigError as exc:
        return m, [f"model.path={m.path}: {exc}"]
    return dataclasses.replace(m, **fields), []


def check_init_from(c: schema.CheckpointConfig, m: schema.ModelConfig) -> list[str]:
    """checkpoint.init_from: a Hugging Face model folder with weights, of exactly the model's shape."""
    if not c.init_from:
        return []
    key = f"checkpoint.init_from={c.init_from}"
    try:
        theirs = hf_config.model_fields(c.init_from)
        stored = hf_config.check_weight_headers(hf_config.weight_files(c.init_from))
    except hf_config.HFConfigError as exc:
        return [f"{key}: {exc}"]
    ours = dataclasses.asdict(m)
    differ = [f"{k}={theirs[k]} (model.{k}={ours[k]})" for k in theirs
              if k != "max_seq_len" and theirs[k] != ours[k]]
    if differ:
        return [f"{key}: its shape differs from the model's: {', '.join(differ[:4])}; "
                f"use model=hf model.path={c.init_from} to take the shape from it"]
    try:
        hf_tensors.check_tensors(stored, m)
    except hf_config.HFConfigError as exc:
        return [f"{key}: {exc}"]
    return []


def check_finite(cfg: schema.RunConfig) -> list[str]:
    """inf and nan for any float key of the schema (OmegaConf accepts them as floats: inf, .inf, nan)."""
    return [f"{key}={value}: not a finite number; use a finite value" for key, value in _float_values(cfg, "")
            if not math.isfinite(value)]


def _float_values(node, prefix: str):
    """(dotted key, value) of every float in a config, walking the dataclasses (and lists, by index)."""
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            yield from _float_values(getattr(node, f.name), f"{prefix}.{f.name}" if prefix else f.name)
    elif isinstance(node, dict):
        for key, item in node.items():
            yield from _float_values(item, f"{prefix}.{key}")
    elif isinstance(node, (list, tuple)):
        for i, item in enumerate(node):
            yield from _float_values(item, f"{prefix}[{i}]")
    elif isinstance(node, float):
        yield prefix, node


def _without_keys(problems: list[str], nonfinite: list[str]) -> list[str]:
    """Drop the range checks' lines about keys already reported as non-finite: one line per key."""
    keys = tuple(line.split("=", 1)[0] + "=" for line in nonfinite)
    return [p for p in problems if not p.startswith(keys)] if keys else problems


def resolve_data_vocab(d: schema.DataConfig, m: schema.ModelConfig) -> schema.DataConfig:
    """data.vocab_size=0 means 'as the model' (256 for the byte-level stdlib corpus)."""
    if d.vocab_size:
        return d
    return dataclasses.replace(d, vocab_size=256 if d.kind == "stdlib" else m.vocab_size)


def world_size(cluster: schema.ClusterConfig) -> int:
    return cluster.nodes * cluster.procs_per_node


def _positive(key: str, value: float) -> list[str]:
    return [] if value > 0 else [f"{key}={value}: must be > 0"]


# optim keys every optimizer uses (the loop clips gradients whatever steps them).
_OPTIM_SHARED = ("name", "grad_clip")


def check_optim_keys(o: schema.OptimConfig) -> list[str]:
    """A key the chosen optimizer does not read, set away from its default, would be silently ignored: refuse it."""
    if o.name not in optimizers.names():
        return []  # declared_problems names it
    reads, default = optimizers.spec(o.name).reads, schema.OptimConfig()
    ignored = [f.name for f in dataclasses.fields(o) if f.name not in reads + _OPTIM_SHARED
               and getattr(o, f.name) != getattr(default, f.name)]
    return [f"optim.{key}={getattr(o, key)}: optim.name={o.name} does not use it (it reads "
            f"{', '.join(reads)}); drop it, or choose an optimizer that does" for key in ignored]


def check_optim_model(o: schema.OptimConfig, m: schema.ModelConfig) -> list[str]:
    """Muon with no hidden matrix to orthogonalize, a low-bit AdamW with no tensor large enough to quantize."""
    if o.name not in optimizers.names() or declared_problems(m, "model") or m.n_layers > MAX_LAYERS or \
            lora.problems(m.lora):
        return []  # declared_problems, check_model and lora.problems name those
    family = registry.spec(m.family)
    blocks = [family.block_tensors(m, i) for i in range(m.n_layers)]
    tensors = [family.embedding_tensor(m), *(t for b in blocks for t in b), *family.head_tensors(m, True)]
    adapters = [t for b in blocks for t in lora.adapter_tensors(b, m.lora)]
    return optimizers.model_problems(o.name, adapters if lora.enabled(m.lora) else tensors)


MIN_HANG_TIMEOUT_S = 1.0


def check_ranges(cfg: schema.RunConfig) -> list[str]:
    """What one field's declared range cannot say: conditions between keys."""
    t, sch = cfg.train, cfg.schedule
    problems = []
    if not cfg.checkpoint.resume:
        problems.append("checkpoint.resume='': use auto (newest checkpoint of this run), never, or a checkpoint/run "
                        "directory")
    if t.eval_every > 0:
        problems += _positive("train.eval_batches", t.eval_batches)
    if 0 < t.hang_timeout_s < MIN_HANG_TIMEOUT_S:
        problems.append(f"train.hang_timeout_s={t.hang_timeout_s}: below {MIN_HANG_TIMEOUT_S:g} s any slow step "
                        "would read as a hang; use 0 (no watchdog) or a few times the slowest step or save")
    if t.steps > 0 and sch.warmup_steps >= t.steps:
        problems.append(f"schedule.warmup_steps={sch.warmup_steps}: warmup is not shorter than training "
                        f"(train.steps={t.steps}); lower it below {t.steps}")
    return problems


MAX_LAYERS = 10_000  # the plan works layer by layer: an absurd count would hang it rather than fail


def check_model(m: schema.ModelConfig, t: schema.TrainConfig) -> list[str]:
    """Shapes that must agree: heads vs kv-heads vs dim, sequence vs model limit, and the family's own checks."""
    if declared_problems(m, "model"):
        return []  # an unknown family or a shape out of its declared range: declared_problems names them
    if m.n_layers > MAX_LAYERS:
        return [f"model.n_layers={m.n_layers}: more than {MAX_LAYERS} layers; "
                "the largest published models have under 200"]
    problems = []
    problems += registry.spec(m.family).problems(m, t.seq_len)
    if m.n_heads % m.n_kv_heads:
        problems.append(f"model.n_kv_heads={m.n_kv_heads}: must divide model.n_heads={m.n_heads} (grouped-query "
                        f"attention); use a divisor such as {_divisors(m.n_heads)}")
    if t.seq_len > m.max_seq_len:
        problems.append(f"train.seq_len={t.seq_len}: longer than model.max_seq_len={m.max_seq_len} of model {m.name}; "
                        f"use at most {m.max_seq_len}")
    return problems


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def check_data(d: schema.DataConfig, m: schema.ModelConfig) -> list[str]:
    problems = []
    if d.kind == "memmap" and not d.datasets:
        for key in ("train_path", "val_path"):
            if not getattr(d, key):
                problems.append(f"data.{key}: required for data.kind=memmap; pass data.{key}=/path/to/tokens.bin")
    if d.kind == "stdlib" and d.vocab_size not in (0, 256):
        problems.append(f"data.vocab_size={d.vocab_size}: the stdlib corpus is byte-level, so its vocabulary is 256")
    if d.vocab_size > m.vocab_size:
        problems.append(f"data.vocab_size={d.vocab_size}: the data has more token ids than "
                        f"model.vocab_size={m.vocab_size}; raise model.vocab_size or pick matching data")
    return problems


def check_cluster(c: schema.ClusterConfig, p: schema.PrecisionConfig) -> list[str]:
    problems = []
    if p.fp8 and c.device == "cuda" and c.gpu in GPUS and not GPUS[c.gpu].fp8:
        fp8_gpus = ", ".join(k for k, v in GPUS.items() if v.fp8)
        problems.append(f"precision=fp8: cluster.gpu={c.gpu} has no fp8 tensor cores; use precision=bf16 or a GPU with "
                        f"them ({fp8_gpus})")
    if p.fp8 and p.compute_dtype != "bf16":
        problems.append(f"precision.compute_dtype={p.compute_dtype}: fp8 training runs on top of bf16; set "
                        "precision.compute_dtype=bf16")
    if p.compute_dtype == "fp16" and not p.loss_scaling:
        problems.append("precision.loss_scaling=false: fp16 gradients underflow without loss scaling; set "
                        "precision.loss_scaling=true or use precision=bf16")
    return problems


def check_names(cfg: schema.RunConfig) -> list[str]:
    """Run names become folder names: no separators, no whitespace. (What a backend's files cannot hold, e.g. a
    runs_dir with spaces in an #SBATCH line, its preflight says: a local run takes any runs_dir.)"""
    problems = []
    if cfg.name and (re.search(r"[\s/]", cfg.name) or cfg.name in (".", "..")):
        problems.append(f"name={cfg.name!r}: a run name is one folder name without spaces or '/'; e.g. "
                        "name=llama7b-lr1e-4")
    return problems


def _strategy_constraints(sh: schema.ShardingConfig) -> list[str]:
    """Problems with the degrees a strategy allows, before any inference."""
    problems, strategy = [], canonical(sh.strategy)
    if strategy == "none":
        if (sh.dp_replicate, sh.dp_shard) != (1, 1):
            problems.append("sharding.strategy=none needs dp_replicate=1 and dp_shard=1; "
                            "choose sharding=ddp or sharding=fsdp for data parallelism")
    elif strategy in REPLICATING and sh.dp_shard != 1:
        problems.append(f"sharding.dp_shard={sh.dp_shard}: strategy {sh.strategy} replicates parameters, "
                        "so dp_shard must be 1 (use sharding=hsdp to combine both)")
    elif strategy in SHARDING_WITHIN_GROUP and sh.dp_replicate != 1:
        problems.append(f"sharding.dp_replicate={sh.dp_replicate}: strategy {sh.strategy} shards within one group, "
                        "so dp_replicate must be 1 (use sharding=hsdp to combine both)")
    return problems


def infer_dims(sh: schema.ShardingConfig, world_size: int) -> tuple[ParallelDims | None, list[str]]:
    """Resolve -1 degrees against `world_size`; returns (dims, problems)."""
    problems = _strategy_constraints(sh) + degree_problems(degrees_of(sh))
    if problems:
        return None, problems
    return infer_degrees(degrees_of(sh), world_size)


def check_offload(sh: schema.ShardingConfig) -> list[str]:
    if sh.cpu_offload and not shards_parameters(sh.strategy):
        return ["sharding.cpu_offload=true: offload is an FSDP2 policy; use sharding=zero3 (or zero2/hsdp), not "
                f"{sh.strategy}"]
    return []


def check_model_parallel(dims: ParallelDims, m: schema.ModelConfig) -> list[str]:
    problems = []
    if m.family not in registry.names():
        return []  # check_model names it
    if dims.tp > 1:
        for key, value in registry.spec(m.family).tp_divides(m).items():
            if value % dims.tp:
                problems.append(f"sharding.tp={dims.tp}: does not divide model.{key}={value}; use a tp degree that "
                                f"divides it ({_divisors(value)})")
    if dims.pp > m.n_layers:
        problems.append(f"sharding.pp={dims.pp}: more pipeline stages than model.n_layers={m.n_layers}")
    return problems


def check_pipeline(
    sh: schema.ShardingConfig, dims: ParallelDims, m: schema.ModelConfig, t: schema.TrainConfig
) -> list[str]:
    """Stages, layer split, schedule and chunking of a pipeline-parallel run."""
    if dims.pp == 1:
        return _pp_layers_problems(sh, 1, m)  # one stage: the plan and the worker still split by pp_layers
    problems = []
    if m.tie_embeddings:
        problems.append("model.tie_embeddings=true: the first and last pipeline stages would share the embedding; use "
                        "sharding.pp=1 or an untied model")
    if t.compile and sh.pp_schedule == "interleaved_zero_bubble":
        # Its split input/weight backward rejects compiled modules (torch 2.11-2.13).
        problems.append("train.compile=true: sharding.pp_schedule=interleaved_zero_bubble cannot run compiled blocks; "
                        "set train.compile=false or use interleaved_1f1b")
    stages = dims.pp * sh.pp_stages_per_rank
    interleaved = sh.pp_schedule.startswith("interleaved")
    if interleaved and sh.pp_stages_per_rank < 2:
        problems.append(f"sharding.pp_stages_per_rank={sh.pp_stages_per_rank}: schedule {sh.pp_schedule} runs several "
                        "stages per rank; set it to 2 or more")
    if not interleaved and sh.pp_stages_per_rank != 1:
        problems.append(f"sharding.pp_stages_per_rank={sh.pp_stages_per_rank}: schedule {sh.pp_schedule} runs one "
                        "stage per rank; set it to 1 or use an interleaved schedule")
    problems += _pp_layers_problems(sh, stages, m)
    if not sh.pp_layers and stages > m.n_layers:
        problems.append(f"sharding.pp={dims.pp} x pp_stages_per_rank={sh.pp_stages_per_rank}: {stages} stages for "
                        f"model.n_layers={m.n_layers}; use fewer stages")
    # Each of the step's grad_accum micro-batches is one pipeline microbatch.
    if sh.pp_schedule != "gpipe" and t.grad_accum < dims.pp:
        problems.append(f"train.grad_accum={t.grad_accum}: schedule {sh.pp_schedule} needs at least "
                        f"sharding.pp={dims.pp} pipeline microbatches per step; raise train.global_batch or lower "
                        "train.micro_batch")
    if interleaved and t.grad_accum % dims.pp:
        problems.append(f"train.grad_accum={t.grad_accum}: interleaved schedules need a multiple of "
                        f"sharding.pp={dims.pp} microbatches per step")
    return problems


def _pp_layers_problems(sh: schema.ShardingConfig, stages: int, m: schema.ModelConfig) -> list[str]:
    if sh.pp_layers and (len(sh.pp_layers) != stages or sum(sh.pp_layers) != m.n_layers or min(sh.pp_layers) < 1):
        return [f"sharding.pp_layers={list(sh.pp_layers)}: needs {stages} positive entries (pp x pp_stages_per_rank) "
                f"summing to model.n_layers={m.n_layers}, or [] for an even split"]
    return []


def check_context_parallel(dims: ParallelDims, c: schema.ClusterConfig, t: schema.TrainConfig) -> list[str]:
    if dims.cp == 1:
        return []
    if c.device != "cuda":
        return [f"sharding.cp={dims.cp}: context parallelism needs CUDA attention kernels (torch's context_parallel); "
                f"use sharding.cp=1 on cluster.device={c.device}"]
    if t.seq_len % (2 * dims.cp):
        return [f"sharding.cp={dims.cp}: train.seq_len={t.seq_len} must be a multiple of 2 x cp = {2 * dims.cp} "
                "(load-balanced sequence shards)"]
    return []


def resolve_batch(t: schema.TrainConfig, dp: int) -> tuple[schema.TrainConfig, list[str]]:
    """global_batch = micro_batch x grad_accum x dp, deriving the one set to -1."""
    values = {"global_batch": t.global_batch, "micro_batch": t.micro_batch, "grad_accum": t.grad_accum}
    problems = [f"train.{k}={v}: must be a positive integer, or -1 to derive "
                "it" for k, v in values.items() if v == 0 or v < -1]
    derived = [k for k, v in values.items() if v == -1]
    if len(derived) > 1:
        problems.append(f"train.{' and train.'.join(derived)} are all -1: set all but one of global_batch, "
                        "micro_batch, grad_accum")
    if problems:
        return t, problems
    g, mb, ga = t.global_batch, t.micro_batch, t.grad_accum
    if derived == ["global_batch"]:
        g = mb * ga * dp
    elif derived:
        other = ga if derived == ["micro_batch"] else mb
        if g % (other * dp):
            return t, [
                f"train.global_batch={g}: not divisible by "
                f"{'grad_accum' if derived == ['micro_batch'] else 'micro_batch'} x data-parallel degree "
                f"= {other} x {dp}; use a multiple of {other * dp}"
            ]
        if derived == ["micro_batch"]:
            mb = g // (ga * dp)
        else:
            ga = g // (mb * dp)
    if g != mb * ga * dp:
        return t, [
            f"train.global_batch={g}: must equal micro_batch x grad_accum x data-parallel degree = {mb} x {ga} x {dp} "
            f"= {mb * ga * dp}; "
            "set one of them to -1 to derive it"
        ]
    return dataclasses.replace(t, global_batch=g, micro_batch=mb, grad_accum=ga), []
