"""Which SDPA kernel the worker's attention will run, predicted without torch for the plan.

The worker asks SDPA for cuDNN, flash, memory-efficient, then math, in that order (train.attention=flash leaves
cuDNN out). SDPA takes the first kernel whose constraints the call meets; the ones that decide here:
- cuDNN and flash need bf16 or fp16 inputs; fp32 runs the memory-efficient kernel (the worker copies the kv
  heads up for it, since enable_gqa runs only in flash and math);
- grouped-query attention (fewer kv heads) passes enable_gqa: flash takes it; whether cuDNN does depends on
  the torch release (pytorch#139586), so the prediction names both and the GPU run says which ran;
- data.document_mask passes an explicit boolean mask, which flash never takes: the memory-efficient kernel;
- cuDNN takes head dims that are multiples of 8 up to 128, flash up to 256.
On CPU SDPA runs its own flash kernel (_scaled_dot_product_flash_attention_for_cpu). The GPU test
(tests/gpu/test_cuda_training.py) checks the prediction against the profiler's kernel names.
"""

from __future__ import annotations

from trainctl.config.schema import RunConfig
from trainctl.models.registry import spec

CUDNN_MAX_HEAD_DIM = 128
FLASH_MAX_HEAD_DIM = 256


def predicted_kernel(cfg: RunConfig) -> tuple[str, str]:
    """(kernel, why): "cudnn", "flash", "cudnn or flash", "efficient" or "cpu-flash"."""
    m = cfg.model
    head_dim = spec(m.family).head_dim(m)  # Qwen3 0.6B: 128 on a 1024 stream of 16 heads
    if cfg.cluster.device != "cuda":
        return "cpu-flash", "SDPA's CPU flash kernel"
    if cfg.precision.compute_dtype == "fp32":
        return "efficient", "fp32 runs neither cuDNN nor flash"
    if cfg.data.document_mask:  # the worker copies the kv heads up for it, as for fp32
        return "efficient", "data.document_mask's explicit block-causal mask: flash takes none (unchecked on a GPU)"
    gqa = m.n_kv_heads != m.n_heads
    if cfg.train.attention == "cudnn" and head_dim % 8 == 0 and head_dim <= CUDNN_MAX_HEAD_DIM:
        if gqa:
            return "cudnn or flash", "grouped-query attention: cuDNN takes enable_gqa in some torch releases only"
        return "cudnn", "first in train.attention's order, and it takes this shape"
    if head_dim <= FLASH_MAX_HEAD_DIM:
        why = ("train.attention=flash" if cfg.train.attention == "flash"
               else f"head dim {head_dim} is not one cuDNN takes")
        return "flash", why
    return "efficient", f"head dim {head_dim} is past flash's {FLASH_MAX_HEAD_DIM}"
