"""Export of a LoRA run: `--merged` folds the adapters into the weights, `--adapter` writes a PEFT folder.

Merged: each adapted weight becomes W + scale * B @ A (in fp32, cast back to the checkpoint's dtype), and the
export goes on as for any run (Hugging Face names, q/k rows reordered, --verify).
Adapter: adapter_config.json (peft_type LORA, r, lora_alpha, lora_dropout, target_modules in Hugging Face's
names) and adapter_model.safetensors with peft's keys (`base_model.model.model.layers.N.self_attn.q_proj.lora_A
.weight`). trainctl's q and k rows are in interleaved rotary order: B (the rows of the update) gets the row
reordering its base weight gets (models/hf.py); A (the columns) is untouched. `peft.PeftModel.from_pretrained`
loads it onto the base model with the merged export's logits.

The routed experts' adapters (core/lora.py EXPERT_TARGETS) go to peft's `target_parameters` (its ParamWrapper on
transformers' fused `mlp.experts.gate_up_proj` and `mlp.experts.down_proj`): per layer and parameter one lora_A
[E * r, in] (expert e's A in rows e*r..) and one lora_B [out, r * E] (column k*E + e: rank k of expert e), as
peft reshapes them. peft nests one wrapper per targeted parameter of a module in the module's registration order
(gate_up_proj, then down_proj), the inner ones under `base_layer.`, so their keys say as much. Merged: w1 and w3
get the gate's and the up's half of A[e] @ B[e], w2 the down adapter's.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import torch

from trainctl.config.schema import LoRAConfig, ModelConfig
from trainctl.core import nf4
from trainctl.core.errors import UserError
from trainctl.core.lora import EXPERT_TARGETS, HF_EXPERT_PARAMETERS, HF_TARGETS, expert_targets, is_adapter, peft_name
from trainctl.models.hf import to_hf, to_hf_name

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def check_mode(cfg: ModelConfig, mode: str | None) -> None:
    """A LoRA run needs --merged or --adapter (neither is a silent default); a full run takes neither."""
    if cfg.lora.rank > 0 and mode is None:
        raise UserError([f"model.lora.rank={cfg.lora.rank}: this run trained LoRA adapters; pass --merged (full "
                         "Hugging Face weights with the adapters folded in) or --adapter (a PEFT adapter folder)"])
    if cfg.lora.rank <= 0 and mode is not None:
        raise UserError([f"--{mode}: this run has no LoRA adapters (model.lora.rank=0); export without --{mode}"])


def base_config(cfg: ModelConfig) -> ModelConfig:
    """The model without adapters: what a merged export holds."""
    return dataclasses.replace(cfg, lora=LoRAConfig())


def base_names(names: list[str]) -> list[str]:
    return [n for n in names if not is_adapter(n)]


# our stacked expert weight -> (its adapter's module, which part of B's columns: gate, up or all)
EXPERT_WEIGHT_ADAPTERS = {"w1": ("gate_up", 0), "w3": ("gate_up", 1), "w2": ("down", None)}


def adapters_of(weight: str) -> tuple[str, str]:
    """`layers.0.attention.wq.weight` -> (its lora_a name, its lora_b name); a stacked expert weight
    `layers.0.feed_forward.experts.w1` -> its experts' adapter's (`...experts.gate_up.lora_a`, ...)."""
    parent, _, leaf = weight.rpartition(".")
    if parent.endswith(".experts") and leaf in EXPERT_WEIGHT_ADAPTERS:
        path = f"{parent}.{EXPERT_WEIGHT_ADAPTERS[leaf][0]}"
    else:
        path = weight.removesuffix(".weight")
    return f"{path}.lora_a", f"{path}.lora_b"


def update_of(weight: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """B @ A in `weight`'s layout (float64): [out, in] for a projection; for a stacked expert weight ([E, in, out])
    A[e] @ B[e] per expert, the gate's or the up's half of the fused gate/up adapter for w1 or w3."""
    a, b = a.double(), b.double()
    leaf = weight.rpartition(".")[2]
    if a.dim() == 2:
        return b @ a
    update = torch.bmm(a, b)
    half = EXPERT_WEIGHT_ADAPTERS[leaf][1]
    return update if half is None else update.chunk(2, dim=-1)[half]


def merged_reader(names: list[str], read: Callable[[list[str]], dict[str, torch.Tensor]],
                  lora: LoRAConfig) -> Callable[[list[str]], dict[str, torch.Tensor]]:
    """A reader of base tensors that reads each adapted weight's A and B with it and folds them in."""
    present = set(names)

    def read_merged(shard: list[str]) -> dict[str, torch.Tensor]:
        extra = [a for n in shard for a in adapters_of(n) if a in present]
        tensors = read(shard + extra)
        return {n: t for n, t in merge(tensors, lora).items() if n in shard}
    return read_merged


def merge(tensors: dict[str, torch.Tensor], lora: LoRAConfig) -> dict[str, torch.Tensor]:
    """Base tensors by name, each adapted weight as W + (alpha / rank) * B @ A (adapters dropped)."""
    scale = lora.alpha / lora.rank
    out = {}
    for name, tensor in tensors.items():
        if is_adapter(name):
            continue
        a_name, b_name = adapters_of(name)
        if a_name in tensors:
            update = update_of(name, tensors[a_name], tensors[b_name])
            tensor = (tensor.double() + scale * update).to(tensor.dtype)
        out[name] = tensor
    return out


def write_adapter(tensors: dict[str, torch.Tensor], cfg: ModelConfig, out: Path, base_model: str = "",
                  revision: str | None = None) -> None:
    """The PEFT folder: adapter_model.safetensors (peft's names, q/k rows of B reordered) and adapter_config.json
    (`revision`: the Hub commit of the base, when it came from the Hub)."""
    from safetensors.torch import save_file

    weights = {}
    for name, tensor in tensors.items():
        if (expert := expert_peft_item(name, tensor, cfg)) is not None:
            weights.update([expert])
            continue
        weight = name.rsplit(".", 1)[0] + ".weight"
        if name.endswith(".lora_b"):
            hf_weight, tensor = to_hf(weight, tensor, cfg)  # the rows of the update follow W's rows
            weights[peft_name(hf_weight, "B")] = tensor.contiguous()
        else:
            weights[peft_name(to_hf_name(weight, cfg), "A")] = tensor.contiguous()
    save_file(weights, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(cfg.lora, base_model, revision), indent=2) + "\n")


def expert_peft_item(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> tuple[str, torch.Tensor] | None:
    """An experts' adapter (`layers.N.feed_forward.experts.gate_up.lora_a` [E, in, r]) as peft's key and tensor for
    its target parameter (module doc); None for any other name."""
    parts = name.split(".")
    targets = {path.rpartition(".")[2]: t for t, path in EXPERT_TARGETS.items()}
    if len(parts) != 6 or parts[2:4] != ["feed_forward", "experts"] or parts[4] not in targets:
        return None
    wanted = expert_targets(cfg.lora)
    # peft wraps the targeted parameters in registration order, each around the last: the first is innermost
    order = [t for t in ("expert_gate_up", "expert_down") if t in wanted]
    depth = len(order) - 1 - order.index(targets[parts[4]])
    module = HF_EXPERT_PARAMETERS[targets[parts[4]]].rpartition(".")[0]
    prefix = f"base_model.model.model.layers.{parts[1]}.{module}.{'base_layer.' * depth}"
    if parts[5] == "lora_a":  # [E, in, r] -> [E * r, in]: expert e's A^T in rows e*r..
        return f"{prefix}lora_A.weight", tensor.transpose(1, 2).reshape(-1, tensor.shape[1]).contiguous()
    # [E, r, out] -> [out, r * E]: column k*E + e holds rank k of expert e's B^T
    return f"{prefix}lora_B.weight", tensor.permute(2, 1, 0).reshape(tensor.shape[2], -1).contiguous()


def adapter_config(lora: LoRAConfig, base_model: str, revision: str | None = None) -> dict:
    """What peft's LoraConfig reads; everything else at peft's defaults."""
    parameters = sorted(HF_EXPERT_PARAMETERS[t] for t in lora.targets if t in HF_EXPERT_PARAMETERS)
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model or None,
            "revision": revision,
            "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
            "target_modules": sorted(HF_TARGETS[t] for t in lora.targets if t in HF_TARGETS),
            **({"target_parameters": parameters} if parameters else {}), "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "inference_mode": True, "modules_to_save": None}


def base_note(cfg: ModelConfig, mode: str | None) -> str | None:
    """What a QLoRA run's export holds of its 4-bit base (model.lora.base_dtype=nf4), in one line; None otherwise."""
    if not nf4.enabled(cfg.lora):
        return None
    if mode == "merged":
        return ("dequantized: the run's base was 4-bit NF4; the merged weights are its dequantized values (fp32) "
                "plus the adapters, not the original full-precision base plus the adapters")
    return ("the adapters were trained on the 4-bit NF4 base: on the full-precision base they compute what they "
            "did in training up to NF4's quantization error")
