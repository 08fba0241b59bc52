"""Parameter counts and training FLOPs of the configured model, without torch: the family's spec says them.

The counts here must equal `sum(p.numel())` of the model the worker builds (tests/unit/test_model.py) and the
published counts of the named models (tests/dist/test_families.py builds transformers' own classes on meta).
"""

from __future__ import annotations

from trainctl.config.schema import ModelConfig
from trainctl.core.float8 import converts
from trainctl.core.lora import adapter_count
from trainctl.models.registry import spec


def head_dim(m: ModelConfig) -> int:
    return spec(m.family).head_dim(m)


def layer_params(m: ModelConfig) -> int:
    """Parameters of one transformer block."""
    return spec(m.family).layer_params(m)


def param_count(m: ModelConfig) -> int:
    """Total parameters, counting a tied embedding once."""
    return spec(m.family).param_count(m)


def matmul_params(m: ModelConfig) -> int:
    """Parameters that take part in a matmul per token: all but the embedding lookup and norms."""
    return spec(m.family).matmul_params(m)


def flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of forward + backward per token (6N plus the attention term; the family's spec)."""
    return spec(m.family).flops_per_token(m, seq_len)


def lora_formula_count(m: ModelConfig) -> int:
    """LoRA's trainable parameters (core/lora.py's count, which the worker reports too)."""
    return adapter_count(m.lora, m.n_layers, lora_shapes(m), m.moe.num_experts)


def trainable_count(m: ModelConfig) -> int:
    """What the optimizer steps: the adapters with model.lora, else every parameter."""
    return lora_formula_count(m) if m.lora.rank > 0 else param_count(m)




def linear_shapes(m: ModelConfig) -> dict[str, tuple[int, int]]:
    """Every weight matmul's (in, out) by its module name in one block (`attention.wq`, ...) and `output`."""
    return spec(m.family).linear_shapes(m)


def lora_shapes(m: ModelConfig) -> dict[str, tuple[int, int]]:
    """What model.lora.targets can adapt in one block, (in, out) by path (one routed expert's for the experts)."""
    return spec(m.family).lora_shapes(m)


def fp8_matmul_params(m: ModelConfig, exclude: list[str] | tuple[str, ...], fp8_filter: str = "all",
                      recipe: str = "tensorwise") -> int:
    """Matmul weights that run in float8 (the worker's rule, core/float8.converts): not excluded by name
    (`precision.fp8_exclude`, matched against `layers.N.<name>` and `output`), both dimensions 16-aligned, and
    under fp8_filter=auto only the shapes torchao's size rule says gain for the recipe."""
    total = 0
    for name, (n_in, n_out) in linear_shapes(m).items():
        fqn = name if name == "output" else f"layers.0.{name}"
        if converts(fp8_filter, recipe, fqn, n_out, n_in, exclude):
            total += n_in * n_out * (1 if name == "output" else m.n_layers)
    return total
