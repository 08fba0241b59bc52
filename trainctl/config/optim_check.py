"""Optimizer checks of a composed RunConfig: keys the chosen optimizer ignores, tensors it cannot step."""

from __future__ import annotations

import dataclasses

from trainctl.config import schema
from trainctl.config.fields import declared_problems
from trainctl.config.model_check import MAX_LAYERS
from trainctl.core import lora, optimizers
from trainctl.models import registry

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
