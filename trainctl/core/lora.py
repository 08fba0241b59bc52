"""LoRA's names, shapes and checks, torch-free: the plan, the validation, the worker and the export share them.

An adapter on a projection `W` [out, in] adds `scale * B @ A` with A [rank, in] and B [out, rank],
scale = alpha / rank (peft's convention). trainctl keeps `W` under its own name (`...wq.weight`) and adds
`...wq.lora_a` and `...wq.lora_b` beside it, so the base weights load, checkpoint and export by the names they
always had.
"""

from __future__ import annotations

from trainctl.core import nf4
from trainctl.core.tensors import Tensor
from trainctl.core.wrapping import shards_parameters

# model.lora.targets -> the projection's module path inside a block (every family shares the llama layout).
TARGETS = {"q": "attention.wq", "k": "attention.wk", "v": "attention.wv", "o": "attention.wo",
           "gate": "feed_forward.w1", "up": "feed_forward.w3", "down": "feed_forward.w2"}
# peft's target_modules for them (Hugging Face's module names).
HF_TARGETS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
              "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
ADAPTER_SUFFIXES = (".lora_a", ".lora_b")


def enabled(lora) -> bool:
    return lora.rank > 0


def is_adapter(name: str) -> bool:
    """Whether a parameter name (trainctl's) is a LoRA adapter's A or B."""
    return name.endswith(ADAPTER_SUFFIXES)


def problems(lora) -> list[str]:
    """One line per bad model.lora key (model.lora: config.schema.LoRAConfig)."""
    out = []
    if lora.rank < 0:
        out.append(f"model.lora.rank={lora.rank}: must be 0 (no LoRA) or positive, e.g. 8 or 16")
    if not lora.alpha > 0:
        out.append(f"model.lora.alpha={lora.alpha}: must be positive (the update is scaled by alpha / rank), e.g. 16")
    if not 0 <= lora.dropout < 1:
        out.append(f"model.lora.dropout={lora.dropout}: must be in [0, 1), e.g. 0.05")
    unknown = [t for t in lora.targets if t not in TARGETS]
    if unknown:
        out.append(f"model.lora.targets={list(lora.targets)}: unknown {', '.join(map(str, unknown))}; "
                   f"choose from {', '.join(TARGETS)}")
    elif len(set(lora.targets)) != len(lora.targets):
        out.append(f"model.lora.targets={list(lora.targets)}: names a projection twice; list each once")
    elif lora.rank > 0 and not lora.targets:
        out.append("model.lora.targets=[]: no projection to adapt; name some of " + ", ".join(TARGETS))
    return out + nf4.problems(lora)


def width_problems(lora, shapes: dict[str, tuple[int, int]]) -> list[str]:
    """What the adapted projections' shapes refuse: torchao's NF4 block sizes (core/nf4.py), and a rank too wide.

    `shapes`: each matmul's (in, out) by its path in a block (the family spec's linear_shapes)."""
    if not enabled(lora) or any(t not in TARGETS for t in lora.targets):
        return []
    return nf4.shape_problems(lora, shapes, TARGETS) + rank_problems(lora, shapes)


def shard_problems(lora, shapes: dict[str, tuple[int, int]], sharding) -> list[str]:
    """QLoRA's 4-bit weights cut by FSDP2 into whole NF4 blocks per rank (core/nf4.py); `sharding` resolved."""
    if not enabled(lora) or any(t not in TARGETS for t in lora.targets) or not shards_parameters(sharding.strategy):
        return []
    return nf4.shard_problems(lora, shapes, TARGETS, sharding.dp_shard)


def rank_problems(lora, shapes: dict[str, tuple[int, int]]) -> list[str]:
    """A rank above a target's min(in, out): B @ A is then no longer low-rank, so the extra rank adds parameters
    (rank x (in + out) each) and memory but nothing a full fine-tune could not do with fewer.

    `shapes`: each matmul's (in, out) by its path in a block (the family spec's linear_shapes)."""
    narrowest = {t: min(shapes[TARGETS[t]]) for t in lora.targets}
    too_narrow = sorted(t for t, width in narrowest.items() if lora.rank > width)
    if not too_narrow:
        return []
    limit = min(narrowest[t] for t in too_narrow)
    return [f"model.lora.rank={lora.rank}: above min(in, out) of {', '.join(too_narrow)} ({limit}), where an "
            f"adapter is no longer low-rank; use a rank of at most {limit} (e.g. 8 or 16), or model.lora.rank=0 "
            "to train every weight"]


def oversized(lora, shapes: dict[str, tuple[int, int]]) -> str | None:
    """A warning when the adapters hold more parameters than the weights they adapt (rank > in*out/(in+out))."""
    if not enabled(lora):
        return None
    paths = [TARGETS[t] for t in lora.targets if t in TARGETS]
    adapters = sum(lora.rank * sum(shapes[p]) for p in paths)
    weights = sum(shapes[p][0] * shapes[p][1] for p in paths)
    if adapters <= weights:
        return None
    return (f"model.lora.rank={lora.rank}: the adapters train {adapters:,} parameters per layer, more than the "
            f"{weights:,} weights they adapt; a smaller rank (e.g. 8 or 16) is the usual LoRA, or "
            "model.lora.rank=0 trains every weight with less")


def target_paths(lora) -> list[str]:
    """The module paths inside a block that carry adapters, in the order of model.lora.targets."""
    return [TARGETS[t] for t in lora.targets]


def adapter_count(lora, n_layers: int, shapes: dict[str, tuple[int, int]]) -> int:
    """LoRA's trainable parameters: per target, rank x (in + out), in every layer; 0 without adapters.

    `shapes`: each matmul's (in, out) by its path in a block (the family spec's linear_shapes)."""
    if not enabled(lora):
        return 0
    return n_layers * sum(lora.rank * sum(shapes[path]) for path in target_paths(lora))


def adapter_tensors(block: list[Tensor], lora) -> list[Tensor]:
    """The A and B tensors the adapters add to one block (`block`: the block's weights, the family's spec)."""
    if not enabled(lora):
        return []
    shapes = {t.name: t for t in block}
    out = []
    for tensor in block:
        path, _, leaf = tensor.name.rpartition(".")
        if leaf == "weight" and any(path.endswith("." + p) for p in target_paths(lora)):
            out += [Tensor(f"{path}.lora_a", lora.rank, shapes[tensor.name].cols),
                    Tensor(f"{path}.lora_b", shapes[tensor.name].rows, lora.rank)]
    return out


def peft_name(trainctl_hf_weight: str, which: str) -> str:
    """peft's key for an adapter: `model.layers.0.self_attn.q_proj.weight`, "A" ->
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`."""
    return f"base_model.model.{trainctl_hf_weight.removesuffix('.weight')}.lora_{which}.weight"


def quantized_base(name: str, lora) -> bool:
    """Whether a parameter name (trainctl's: `layers.0.attention.wq.weight`) is a 4-bit (NF4) base weight."""
    if not nf4.enabled(lora):
        return False
    path, _, leaf = name.rpartition(".")
    return leaf == "weight" and any(path.endswith("." + p) for p in target_paths(lora))
