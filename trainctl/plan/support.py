"""What the worker implements today, checked without torch.

Valid configs the worker cannot run yet (pipeline/context parallelism, zero1,
offload, fp8, fp16) are listed here once: the plan shows them as warnings, `launch`
refuses them before anything is submitted, and the worker refuses them at startup.
"""

from __future__ import annotations

from trainctl.config.schema import PrecisionConfig, ShardingConfig


def unsupported(sharding: ShardingConfig, precision: PrecisionConfig) -> list[str]:
    """One line per requested feature the worker does not implement yet."""
    later = [
        (sharding.pp > 1, f"sharding.pp={sharding.pp}: pipeline parallelism is not implemented in the worker yet; use sharding.pp=1"),
        (sharding.cp > 1, f"sharding.cp={sharding.cp}: context parallelism is not implemented in the worker yet; use sharding.cp=1"),
        (sharding.strategy == "zero1", "sharding.strategy=zero1: optimizer-state sharding is not implemented in the worker yet; use sharding=ddp or sharding=zero2"),
        (sharding.cpu_offload, "sharding.cpu_offload=true: CPU offload is not implemented in the worker yet; set it to false"),
        (precision.fp8, "precision.fp8=true: float8 training is not implemented in the worker yet; use precision=bf16"),
        (precision.compute_dtype == "fp16", "precision.compute_dtype=fp16: fp16 with loss scaling is not implemented in the worker yet; use precision=bf16"),
    ]
    return [message for wanted, message in later if wanted]
