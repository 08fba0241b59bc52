"""What the worker implements today, checked without torch.

Valid configs the worker cannot run yet (context parallelism with pipelines or zero1, zero1 over
tp or pp) are listed here once: the plan shows them as warnings, `launch` refuses them before
anything is submitted, and the worker refuses them at startup.
"""

from __future__ import annotations

from trainctl.core import nf4  # the 4-bit base's own layouts
from trainctl.core.wrapping import shards_parameters


def unsupported(sharding, precision) -> list[str]:
    """One line per requested feature the worker does not implement yet (config.schema's sharding and precision)."""
    cp, tp, pp, zero1 = sharding.cp, sharding.tp, sharding.pp, sharding.strategy == "zero1"
    later = [
        (cp > 1 and pp > 1, f"sharding.cp={cp}: context parallelism with sharding.pp={pp} is not implemented "
                            "in the worker yet; use sharding.pp=1 or sharding.cp=1"),
        (cp > 1 and zero1, f"sharding.cp={cp}: context parallelism with sharding=zero1 is not implemented "
                           "in the worker yet; use sharding=zero2 or fsdp"),
        # ZeroRedundancyOptimizer shards whole plain tensors; over TP the parameters are DTensors.
        (zero1 and tp > 1, f"sharding.strategy=zero1: optimizer-state sharding over sharding.tp={tp} is not "
                           "implemented in the worker yet; use sharding=zero2 or sharding=fsdp with tp"),
        # zero1 keeps DDP for the gradients, and DDP's reducer breaks under a pipeline schedule.
        (zero1 and pp > 1, f"sharding.strategy=zero1: optimizer-state sharding with sharding.pp={pp} is not "
                           "implemented in the worker yet; use sharding=zero2 or sharding=fsdp with pp"),
    ]
    return [message for wanted, message in later if wanted]


def lora_unsupported(lora, sharding, precision) -> list[str]:
    """One line per layout LoRA (model.lora.rank > 0) does not compose with in the worker yet."""
    if lora.rank <= 0:
        return []

    later = [
        # Tensor and pipeline parallelism swap or split the projections LoRA wraps; float8 swaps them too.
        (sharding.tp > 1, f"sharding.tp={sharding.tp}"),
        (sharding.pp > 1, f"sharding.pp={sharding.pp}"),
        (sharding.cp > 1, f"sharding.cp={sharding.cp}"),
        (precision.fp8, "precision.fp8=true"),
    ]
    return [f"model.lora.rank={lora.rank}: LoRA with {key} is not implemented in the worker yet; use "
            "data parallelism (sharding=ddp, zero1, zero2, fsdp or hsdp) without fp8, or model.lora.rank=0"
            for wanted, key in later if wanted] + nf4.layout_problems(lora, shards_parameters(sharding.strategy),
                                                             sharding.cpu_offload)
