"""LoRA's names, shapes and checks, torch-free: the plan, the validation, the worker and the export share them.

An adapter on a projection `W` [out, in] adds `scale * B @ A` with A [rank, in] and B [out, rank],
scale = alpha / rank (peft's convention). trainctl keeps `W` under its own name (`...wq.weight`) and adds
`...wq.lora_a` and `...wq.lora_b` beside it, so the base weights load, checkpoint and export by the names they
always had.

A mixture of experts' routed experts (models/common/experts.py: stacked w1, w3 [E, dim, hidden], w2 [E, hidden,
dim]) take one adapter per expert on two targets, the two stacked parameters transformers (>= 5) holds and peft
adapts (`LoraConfig(target_parameters=[...])`, its ParamWrapper): `expert_gate_up` on the fused gate and up
projection (`mlp.experts.gate_up_proj` [E, 2 hidden, dim]: one A per expert shared by gate and up, B's rows the
gate's then the up's) and `expert_down` on `mlp.experts.down_proj`. Separate gate and up adapters would have no
place in peft's format, so they are not offered. They sit beside the experts as `...experts.gate_up.lora_a`
[E, dim, r] / `.lora_b` [E, r, 2 hidden] and `...experts.down.lora_a` [E, hidden, r] / `.lora_b` [E, r, dim],
input-major like the experts' weights (peft's per-expert A is lora_a[e]^T, B is lora_b[e]^T); dim 0 is the expert,
so FSDP2 and expert parallelism split them with their experts. peft applies no dropout to a parameter's adapter,
so dropout and the 4-bit base are refused with them.
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
# The routed experts' targets -> their adapter's module path inside a block (a mixture-of-experts family's), and
# peft's target_parameters for them (transformers' fused expert parameters).
EXPERT_TARGETS = {"expert_gate_up": "feed_forward.experts.gate_up", "expert_down": "feed_forward.experts.down"}
HF_EXPERT_PARAMETERS = {"expert_gate_up": "mlp.experts.gate_up_proj", "expert_down": "mlp.experts.down_proj"}
ALL_TARGETS = {**TARGETS, **EXPERT_TARGETS}
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
    unknown = [t for t in lora.targets if t not in ALL_TARGETS]
    if unknown:
        split = " (the experts' gate and up share one adapter, as peft's gate_up_proj: expert_gate_up)" \
            if {"expert_gate", "expert_up"} & set(map(str, unknown)) else ""
        out.append(f"model.lora.targets={list(lora.targets)}: unknown {', '.join(map(str, unknown))}{split}; "
                   f"choose from {', '.join(ALL_TARGETS)}")
    elif len(set(lora.targets)) != len(lora.targets):
        out.append(f"model.lora.targets={list(lora.targets)}: names a projection twice; list each once")
    elif lora.rank > 0 and not lora.targets:
        out.append("model.lora.targets=[]: no projection to adapt; name some of " + ", ".join(TARGETS))
    return out + expert_problems(lora) + nf4.problems(lora)


def expert_targets(lora) -> list[str]:
    """The routed experts' targets among model.lora.targets (none without LoRA)."""
    return [t for t in lora.targets if t in EXPERT_TARGETS] if enabled(lora) else []


def expert_problems(lora) -> list[str]:
    """What peft cannot say of an expert adapter (its ParamWrapper): dropout; and the 4-bit base is not built."""
    experts = expert_targets(lora)
    if not experts:
        return []
    out = []
    if lora.dropout > 0:
        out.append(f"model.lora.dropout={lora.dropout}: peft applies no dropout to the experts' adapters "
                   f"({', '.join(experts)}), so an exported adapter could not hold it; use model.lora.dropout=0, "
                   "or adapt attention only (q, k, v, o)")
    if lora.base_dtype == "nf4":
        out.append(f"model.lora.base_dtype=nf4: the 4-bit base is not implemented for the stacked experts "
                   f"({', '.join(experts)}); use model.lora.base_dtype=fp32, or adapt attention only (q, k, v, o)")
    return out


def width_problems(lora, shapes: dict[str, tuple[int, int]]) -> list[str]:
    """What the adapted projections' shapes refuse: torchao's NF4 block sizes (core/nf4.py), and a rank too wide.

    `shapes`: each matmul's (in, out) by its path in a block (the family spec's lora_shapes)."""
    if not enabled(lora) or any(t not in ALL_TARGETS for t in lora.targets):
        return []
    absent = [t for t in lora.targets if ALL_TARGETS[t] not in shapes]
    if absent:
        return [f"model.lora.targets={list(lora.targets)}: this model has no {', '.join(absent)} (routed experts "
                f"are a mixture-of-experts family's: qwen3_moe, mixtral); adapt "
                f"{', '.join(t for t, path in ALL_TARGETS.items() if path in shapes)}"]
    quantized = [] if expert_problems(lora) else nf4.shape_problems(lora, shapes, TARGETS)  # nf4 refused already
    return quantized + rank_problems(lora, shapes)


def shard_problems(lora, shapes: dict[str, tuple[int, int]], sharding) -> list[str]:
    """QLoRA's 4-bit weights cut by FSDP2 into whole NF4 blocks per rank (core/nf4.py); `sharding` resolved."""
    if not enabled(lora) or any(t not in TARGETS for t in lora.targets) or not shards_parameters(sharding.strategy):
        return []
    return nf4.shard_problems(lora, shapes, TARGETS, sharding.dp_shard)


def rank_problems(lora, shapes: dict[str, tuple[int, int]]) -> list[str]:
    """A rank above a target's min(in, out): B @ A is then no longer low-rank, so the extra rank adds parameters
    (rank x (in + out) each) and memory but nothing a full fine-tune could not do with fewer.

    `shapes`: each matmul's (in, out) by its path in a block (the family spec's lora_shapes)."""
    narrowest = {t: min(shapes[ALL_TARGETS[t]]) for t in lora.targets}
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
    paths = [ALL_TARGETS[t] for t in lora.targets if ALL_TARGETS.get(t) in shapes]
    adapters = sum(lora.rank * sum(shapes[p]) for p in paths)
    weights = sum(shapes[p][0] * shapes[p][1] for p in paths)
    if adapters <= weights:
        return None
    return (f"model.lora.rank={lora.rank}: the adapters train {adapters:,} parameters per layer, more than the "
            f"{weights:,} weights they adapt; a smaller rank (e.g. 8 or 16) is the usual LoRA, or "
            "model.lora.rank=0 trains every weight with less")


def target_paths(lora) -> list[str]:
    """The nn.Linear module paths inside a block that carry adapters (LoRALinear), in the order of
    model.lora.targets; the experts' adapters are expert_targets'."""
    return [TARGETS[t] for t in lora.targets if t in TARGETS]


def adapter_count(lora, n_layers: int, shapes: dict[str, tuple[int, int]], experts: int = 0) -> int:
    """LoRA's trainable parameters: per target, rank x (in + out), in every layer (times `experts` for the routed
    experts' targets, one adapter each); 0 without adapters.

    `shapes`: each matmul's (in, out) by its path in a block, one expert's for the experts (the family spec's
    lora_shapes)."""
    if not enabled(lora):
        return 0
    per_layer = sum(lora.rank * sum(shapes[TARGETS[t]]) for t in lora.targets if t in TARGETS)
    per_layer += experts * sum(lora.rank * sum(shapes[EXPERT_TARGETS[t]]) for t in expert_targets(lora))
    return n_layers * per_layer


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
    return out + expert_adapter_tensors(block, lora)


def expert_adapter_tensors(block: list[Tensor], lora) -> list[Tensor]:
    """The experts' adapters of one block ([E, in, r] and [E, r, out], rows = E as FSDP2 shards them).

    The widths are read off the block as the family's spec lists it (models/common/moe_shape.py): the router
    [E, dim] and w1 [E, dim x hidden]."""
    wanted = expert_targets(lora)
    router = next((t for t in block if t.name.endswith("feed_forward.router.weight")), None)
    w1 = next((t for t in block if t.name.endswith("feed_forward.experts.w1")), None)
    if not wanted or router is None or w1 is None:
        return []
    prefix = w1.name.removesuffix("w1")
    e, dim, hidden, r = w1.rows, router.cols, w1.cols // router.cols, lora.rank
    widths = {"expert_gate_up": (dim, 2 * hidden), "expert_down": (hidden, dim)}
    out = []
    for target in ("expert_gate_up", "expert_down"):  # registration order (models/common/experts.py)
        if target in wanted:
            n_in, n_out = widths[target]
            leaf = EXPERT_TARGETS[target].rpartition(".")[2]
            out += [Tensor(f"{prefix}{leaf}.lora_a", e, n_in * r), Tensor(f"{prefix}{leaf}.lora_b", e, r * n_out)]
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
