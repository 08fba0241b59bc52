"""train.objective against the data and the layout: preference objectives read prepared preference pairs, SFT
never does, and a layout that cannot keep a pair's log-probabilities on one rank is refused (core/objectives.py)."""

from __future__ import annotations

from trainctl.config.schema import CheckpointConfig, DataConfig, LoRAConfig, MoEConfig, TrainConfig
from trainctl.core import lora, objectives
from trainctl.data import format as dataset

PREPARE = "`trainctl data prepare --format preference`"


def _contents(d: DataConfig) -> dict[str, str]:
    """Each readable dataset's content (an unreadable one is reported by datasets_problems)."""
    found = {}
    for path in d.datasets if d.kind == "memmap" else []:
        try:
            found[path] = dataset.read_meta(path).content
        except dataset.DatasetError:
            continue
    return found


def objective_problems(train: TrainConfig, d: DataConfig, adapters: LoRAConfig, checkpoint: CheckpointConfig,
                       sharding, moe: MoEConfig | None = None) -> list[str]:
    """One line per problem of train.objective with this data, layout (resolved degrees) and start point."""
    name = train.objective
    if name not in objectives.OBJECTIVES:
        return []  # the declared choice names it
    contents = _contents(d)
    if not objectives.is_preference(name):
        return [f"train.objective={name}: {path} holds preference pairs; train on them with train.objective=dpo "
                "or simpo, or prepare the records with --format chat" for path, c in contents.items()
                if c == "preference"]
    head = f"train.objective={name}"
    problems = objectives.unsupported(name, sharding)
    if d.kind != "memmap" or not d.datasets:
        problems.append(f"{head}: trains on preference pairs; use data=memmap data.datasets=[DIR] prepared with "
                        f"{PREPARE}")
    problems += [f"{head}: {path} holds {c} data, not preference pairs; prepare the pairs with {PREPARE}"
                 for path, c in contents.items() if c != "preference"]
    if d.weights:
        problems.append(f"data.weights: {head} reads every pair of data.datasets alike; drop data.weights")
    if d.document_mask:
        problems.append(f"data.document_mask=true: {head} gives each answer a row of its own already; set "
                        "data.document_mask=false")
    if train.batch_ramp.start or train.batch_ramp.steps:
        problems.append(f"train.batch_ramp: {head} steps whole pairs at a fixed batch (the pair sampler has no ramp); "
                        "drop train.batch_ramp.start and train.batch_ramp.steps")
    if moe is not None and moe.num_experts and (moe.aux_loss_coef or moe.bias_update_rate):
        # The pair objectives' step adds no auxiliary loss and logs no expert load (train/loop/expert_load.py).
        problems.append(f"model.moe: {head} does not balance a mixture of experts' load; set "
                        "model.moe.aux_loss_coef=0 and model.moe.bias_update_rate=0, or train with train.objective=sft")
    frozen = objectives.cost(name, lora.enabled(adapters)).reference_weights
    if frozen and checkpoint.resume not in ("auto", "never"):
        problems.append(f"checkpoint.resume={checkpoint.resume}: {head} without LoRA rebuilds its frozen reference "
                        "from the seeded init or checkpoint.init_from when it resumes, never from another run's "
                        "checkpoint; export that run (`trainctl export RUN --out DIR`) and pass "
                        "checkpoint.init_from=DIR, or use model.lora.rank > 0")
    return problems
