"""What the worker implements today, checked without torch.

Valid configs the worker cannot run yet (context parallelism with
pipelines or zero1, zero1 over tp or pp) are listed here once: the plan shows them as warnings, `launch`
refuses them before anything is submitted, and the worker refuses them at startup.
"""

from __future__ import annotations

from trainctl.config.schema import PrecisionConfig, ShardingConfig


def unsupported(sharding: ShardingConfig, precision: PrecisionConfig) -> list[str]:
    """One line per requested feature the worker does not implement yet."""
    later = [
        (sharding.cp > 1 and sharding.pp > 1, f"sharding.cp={sharding.cp}: context parallelism with sharding.pp={sharding.pp} is not implemented in the worker yet; use sharding.pp=1 or sharding.cp=1"),
        (sharding.cp > 1 and sharding.strategy == "zero1", f"sharding.cp={sharding.cp}: context parallelism with sharding=zero1 is not implemented in the worker yet; use sharding=zero2 or fsdp"),
        # ZeroRedundancyOptimizer shards whole plain tensors; over TP the parameters are DTensors.
        (sharding.strategy == "zero1" and sharding.tp > 1, f"sharding.strategy=zero1: optimizer-state sharding over sharding.tp={sharding.tp} is not implemented in the worker yet; use sharding=zero2 or sharding=fsdp with tp"),
        # zero1 keeps DDP for the gradients, and DDP's reducer breaks under a pipeline schedule.
        (sharding.strategy == "zero1" and sharding.pp > 1, f"sharding.strategy=zero1: optimizer-state sharding with sharding.pp={sharding.pp} is not implemented in the worker yet; use sharding=zero2 or sharding=fsdp with pp"),
    ]
    return [message for wanted, message in later if wanted]
