"""The batch math of a composed RunConfig: global_batch = micro_batch x grad_accum x data-parallel degree."""

from __future__ import annotations

import dataclasses

from trainctl.config import schema


def resolve_batch(t: schema.TrainConfig, dp: int) -> tuple[schema.TrainConfig, list[str]]:
    """global_batch = micro_batch x grad_accum x dp, deriving the one set to -1."""
    values = {"global_batch": t.global_batch, "micro_batch": t.micro_batch, "grad_accum": t.grad_accum}
    problems = [f"train.{k}={v}: must be a positive integer, or -1 to derive "
                "it" for k, v in values.items() if v == 0 or v < -1]
    derived = [k for k, v in values.items() if v == -1]
    if len(derived) > 1:
        problems.append(f"train.{' and train.'.join(derived)} are all -1: set all but one of global_batch, "
                        "micro_batch, grad_accum")
    if problems:
        return t, problems
    g, mb, ga = t.global_batch, t.micro_batch, t.grad_accum
    if derived == ["global_batch"]:
        g = mb * ga * dp
    elif derived:
        other = ga if derived == ["micro_batch"] else mb
        if g % (other * dp):
            return t, [
                f"train.global_batch={g}: not divisible by "
                f"{'grad_accum' if derived == ['micro_batch'] else 'micro_batch'} x data-parallel degree "
                f"= {other} x {dp}; use a multiple of {other * dp}"
            ]
        if derived == ["micro_batch"]:
            mb = g // (ga * dp)
        else:
            ga = g // (mb * dp)
    if g != mb * ga * dp:
        return t, [
            f"train.global_batch={g}: must equal micro_batch x grad_accum x data-parallel degree = {mb} x {ga} x {dp} "
            f"= {mb * ga * dp}; "
            "set one of them to -1 to derive it"
        ]
    return dataclasses.replace(t, global_batch=g, micro_batch=mb, grad_accum=ga), []
