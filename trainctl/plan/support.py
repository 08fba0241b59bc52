"""What the worker implements today, checked without torch.

Valid configs the worker cannot run yet (pipeline/context parallelism,
zero1 over tp) are listed here once: the plan shows them as warnings, `launch`
refuses them before anything is submitted, and the worker refuses them at startup.
"""

from __future__ import annotations

from trainctl.config.schema import PrecisionConfig, ShardingConfig


def unsupported(sharding: ShardingConfig, precision: PrecisionConfig) -> list[str]:
    """One line per requested feature the worker does not implement yet (every precision option runs now)."""
    later = [
        (sharding.pp > 1, f"sharding.pp={sharding.pp}: pipeline parallelism is not implemented in the worker yet; use sharding.pp=1"),
        (sharding.cp > 1, f"sharding.cp={sharding.cp}: context parallelism is not implemented in the worker yet; use sharding.cp=1"),
        # ZeroRedundancyOptimizer shards whole plain tensors; over TP the parameters are DTensors.
        (sharding.strategy == "zero1" and sharding.tp > 1, f"sharding.strategy=zero1: optimizer-state sharding over sharding.tp={sharding.tp} is not implemented in the worker yet; use sharding=zero2 or sharding=fsdp with tp"),
    ]
    return [message for wanted, message in later if wanted]
