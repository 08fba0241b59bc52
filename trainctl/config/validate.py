"""Cross-field validation and resolution of a composed RunConfig.

`resolve(cfg)` checks everything that can be checked before launch, collects every
problem (one line each: the key, the value, why, what would work) and raises one
`ConfigError`; on success it returns the config with every derived value filled
in (parallel degrees, batch math), which is what the worker receives. The checks of one concern live in
their own modules: model_check (shapes), optim_check (optimizer keys), layout_check (degrees, pipeline,
context parallelism), batch (the batch math), data_check (data sources).
"""

from __future__ import annotations

import dataclasses
import math
import re

from trainctl.config import hf_config, hf_tensors, schema
from trainctl.config.batch import resolve_batch
from trainctl.config.data_check import datasets_problems, document_mask_problems, model_tokenizer_problems
from trainctl.config.errors import ConfigError
from trainctl.config.fields import declared_problems
from trainctl.config.hf_data_check import hf_data_problems, resolve_hf_data
from trainctl.config.layout_check import (
    check_context_parallel,
    check_expert_parallel,
    check_offload,
    check_pipeline,
    infer_dims,
)
from trainctl.config.model_check import check_model, check_model_parallel
from trainctl.config.objective_check import objective_problems
from trainctl.config.optim_check import check_optim_keys, check_optim_model
from trainctl.config.resume_source import check_resume_optimizer
from trainctl.config.schema import MAX_SEED  # noqa: F401 (tests import it from here)
from trainctl.core import batch_ramp, hub, lora, optimizers
from trainctl.core.gpus import GPUS
from trainctl.core.support import lora_unsupported
from trainctl.core.wrapping import canonical, wrapping
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
        problems += lora.width_problems(cfg.model.lora, registry.spec(cfg.model.family).lora_shapes(cfg.model))
    # Without a positive world size the degrees and the batch math mean nothing (and divide by it).
    dims = None
    if cfg.cluster.nodes >= 1 and cfg.cluster.procs_per_node >= 1:
        dims, topo_problems = infer_dims(cfg.sharding, world_size(cfg.cluster))
        problems += topo_problems
    if dims is not None:
        problems += check_model_parallel(dims, cfg.model)
        resolved = dataclasses.replace(cfg.sharding, **dims.as_dict())
        problems += lora_unsupported(cfg.model.lora, resolved, cfg.precision)
        if not model_problems and not declared_problems(cfg.model, "model"):
            problems += lora.shard_problems(cfg.model.lora, registry.spec(cfg.model.family).linear_shapes(cfg.model),
                                            resolved)
        problems += optimizers.unsupported(cfg.optim.name, wrapping(cfg.sharding.strategy, dims), dims.tp)
        train, batch_problems = resolve_batch(cfg.train, dims.dp)
        problems += batch_problems
        problems += check_pipeline(cfg.sharding, dims, cfg.model, train)
        problems += [] if batch_problems else batch_ramp.problems(train, dims.dp, dims.pp, cfg.schedule.warmup_steps)
        problems += check_context_parallel(dims, cfg.cluster, train)
        problems += check_expert_parallel(cfg.sharding, dims, cfg.model, train)
        problems += datasets_problems(cfg.data, cfg.model.vocab_size, train)
        problems += document_mask_problems(cfg.data, dims.pp, dims.cp)
        problems += objective_problems(train, cfg.data, cfg.model.lora, cfg.checkpoint, resolved, cfg.model.moe)
        problems += model_tokenizer_problems(cfg.data, cfg.checkpoint.init_from or cfg.model.path)
        problems += hf_data_problems(cfg.data, cfg.model, cfg.checkpoint, train)
    problems = nonfinite + _without_keys(problems, nonfinite)
    if problems:
        raise ConfigError(problems)
    assert dims is not None  # a world size below 1 is a range problem above
    # The alias (fsdp) is resolved here, once: downstream code sees only the strategy it names.
    sharding = dataclasses.replace(cfg.sharding, strategy=canonical(cfg.sharding.strategy), **dims.as_dict())
    data = resolve_hf_data(resolve_data_vocab(cfg.data, cfg.model), cfg.model, cfg.checkpoint)
    return dataclasses.replace(cfg, sharding=sharding, train=train, data=data)


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
    if "moe" in fields:  # a mixture of experts: its shape from config.json, the training knobs the user's
        fields["moe"] = dataclasses.replace(m.moe, **fields["moe"])
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
    moe = theirs.pop("moe", {})  # a mixture of experts: compare its shape keys, not the training knobs
    theirs.update({f"moe.{k}": v for k, v in moe.items()})
    ours.update({f"moe.{k}": v for k, v in ours["moe"].items()})
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
