"""The worker's actual wrappers match core.wrapping's decision, for every recipe and a grid of layouts.

One process, a fake process group of the config's world size (torch's FakeStore: collectives are no-ops),
tiny model shapes that keep each layout valid: train.parallelize runs as in a real job (pipeline stages of
pp rank 0, float8, TP, FSDP2 or DDP, materialization), then each module's wrapper, its FSDP2 units, their
reshard_after_forward, mixed-precision policy and data-parallel mesh, the autocast context and the optimizer
are compared with `wrapping(...)`. What core/support.py says the worker does not implement is skipped there.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel
from torch.testing._internal.distributed.fake_pg import FakeStore

from trainctl.config.compose import compose, list_options
from trainctl.config.errors import ConfigError
from trainctl.config.validate import resolve
from trainctl.core.dims import ParallelDims
from trainctl.core.stages import local_stage_ids, stage_layers
from trainctl.core.support import unsupported
from trainctl.core.wrapping import Wrapping, wrapping_of
from trainctl.train.loop.micro_batch import MicroBatchContext
from trainctl.train.optim import build_optimizer, zero1_group
from trainctl.train.parallel.distributed import build_mesh
from trainctl.train.parallel.parallelize import parallelize
from trainctl.train.parallel.pipeline import build_stage_model
from trainctl.train.parallel.precision import DTYPES

RECIPES = list_options("recipe")
CPU = torch.device("cpu")


def tiny_overrides(tp: int, pp_stages: int, cp: int) -> list[str]:
    """A model small enough to build in milliseconds that every tp, pp and cp degree of the grid divides."""
    heads = 2 * tp
    seq_len = 32 * cp
    return [
        f"model.dim={16 * heads}", f"model.n_heads={heads}", f"model.n_kv_heads={tp}", f"model.ffn_dim={64 * tp}",
        f"model.n_layers={pp_stages}", "model.vocab_size=256", f"model.max_seq_len={seq_len}",
        f"train.seq_len={seq_len}", "sharding.pp_layers=[]", "data=synthetic", "train.compile=false",
    ]


def recipe_config(recipe: str):
    """The recipe's parallel layout, precision and cluster, on a tiny model."""
    sharding = resolve(compose([f"recipe={recipe}"])).sharding
    stages = sharding.pp * (sharding.pp_stages_per_rank if sharding.pp > 1 else 1)
    return resolve(compose([f"recipe={recipe}", *tiny_overrides(sharding.tp, stages, sharding.cp)]))


# dp degrees per strategy: replicated, sharded, or both (hsdp), so that every wrapper meets a real group.
DEGREES = {
    "none": (1, 1), "ddp": (2, 1), "zero1": (2, 1), "zero2": (1, 2), "zero3": (1, 2), "fsdp": (1, 2), "hsdp": (2, 2),
}
GRID = list(itertools.product(DEGREES, (1, 2), (1, 2), ("fp32", "bf16", "fp16", "fp8")))


def grid_config(strategy: str, tp: int, pp: int, precision: str):
    replicate, shard = DEGREES[strategy]
    world = replicate * shard * tp * pp
    return resolve(compose([
        "recipe=tiny_cpu", f"sharding={strategy}", f"precision={precision}", f"sharding.dp_replicate={replicate}",
        f"sharding.dp_shard={shard}", f"sharding.tp={tp}", f"sharding.pp={pp}", "sharding.pp_schedule=1f1b",
        f"cluster.procs_per_node={world}", "train.global_batch=-1", "train.micro_batch=1", "train.grad_accum=2",
        *tiny_overrides(tp, pp, 1),
        # every Linear in float8: the auto filter converts none at the tiny model's widths, and this grid checks wrapping
        *(["precision.fp8_filter=all"] if precision == "fp8" else []),
    ]))


@contextlib.contextmanager
def fake_world(size: int):
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def build_parts(cfg, mesh) -> list[torch.nn.Module]:
    """What the worker trains on pp rank 0: the whole model, or each of its pipeline stages (as pipeline.py)."""
    sharding = cfg.sharding
    stages_per_rank = sharding.pp_stages_per_rank if sharding.pp > 1 else 1
    n_stages = sharding.pp * stages_per_rank
    layers = stage_layers(cfg.model.n_layers, n_stages, list(sharding.pp_layers))
    parts = []
    for stage in local_stage_ids(0, sharding.pp, stages_per_rank):
        part = build_stage_model(cfg.model, layers[stage], first=stage == 0, last=stage == n_stages - 1)
        parts.append(parallelize(part, mesh, sharding, cfg.train, cfg.precision, CPU))
    return parts


def unit_state(module: torch.nn.Module):
    return module._get_fsdp_state()


def expected_units(model: torch.nn.Module, wrap: Wrapping) -> set[str]:
    """Names of the modules FSDP2 must have made units of ('' is the root)."""
    if not wrap.fully_shard:
        return set()
    blocks = {f"layers.{key}" for key in model.layers}
    if wrap.fsdp_as_ddp:
        return {"", *blocks}
    tied = model.cfg.tie_embeddings
    ends = {name for name in ("tok_embeddings", "norm", "output") if getattr(model, name, None) is not None}
    return {"", *blocks} | (set() if tied else ends)


def dp_dim_names(wrap: Wrapping, cp: int) -> tuple[str, ...]:
    """The mesh dims the data-parallel group spans; under cp the cp ranks join them (flatten_dp_cp)."""
    if cp == 1:
        return wrap.dp_mesh
    if wrap.dp_mesh == ("dp_replicate",):
        return ("dp_cp",)
    return tuple("dp_shard_cp" if name == "dp_shard" else name for name in wrap.dp_mesh)


def check_unit(name: str, module, wrap: Wrapping, cfg) -> None:
    state = unit_state(module)
    group = state._fsdp_param_group
    assert group is not None or name == "", f"{name}: an FSDP2 unit without parameters"
    if group is not None:
        # The root and the head are used last in forward and first in backward: never resharded in between.
        resharded = wrap.reshard_after_forward and name not in ("", "norm", "output")
        assert (group.post_forward_mesh_info is not None) == resharded, f"{name}: reshard_after_forward"
        assert group.mesh_info.mesh.mesh_dim_names == dp_dim_names(wrap, cfg.sharding.cp), name
    policy = state._mp_policy
    want_param = None if wrap.param_dtype is None else DTYPES[wrap.param_dtype]
    want_reduce = None if wrap.reduce_dtype is None else DTYPES[wrap.reduce_dtype]
    assert (policy.param_dtype, policy.reduce_dtype) == (want_param, want_reduce), f"{name}: {policy}"


def check_part(part: torch.nn.Module, wrap: Wrapping, cfg, mesh) -> None:
    assert isinstance(part, DistributedDataParallel) == wrap.ddp
    model = part.module if isinstance(part, DistributedDataParallel) else part
    if wrap.ddp:
        replicas = 1
        for name in dp_dim_names(wrap, cfg.sharding.cp):
            replicas *= mesh[name].size()
        assert part.process_group.size() == replicas
    units = {name for name, module in model.named_modules() if isinstance(module, FSDPModule)}
    assert units == expected_units(model, wrap)
    for name in units:
        check_unit(name, model.get_submodule(name) if name else model, wrap, cfg)
    if wrap.float8_all_gather:
        linears = [m for m in model.modules() if type(m).__name__ == "Float8Linear"]
        assert linears and all(m.config.enable_fsdp_float8_all_gather for m in linears)
    optimizer = build_optimizer(part, cfg.optim, "cpu", zero1_group(wrapping_of(cfg.sharding, cfg.precision), mesh))
    assert isinstance(optimizer, ZeroRedundancyOptimizer) == wrap.zero1


def check_precision_path(wrap: Wrapping, cfg) -> None:
    """The context the worker enters around forward and loss: autocast exactly when the decision says so."""
    contexts = MicroBatchContext(model=torch.nn.Identity(), precision=cfg.precision,
                                 wrap=wrapping_of(cfg.sharding, cfg.precision), device=CPU)
    context = contexts.autocast()  # what the worker's micro-batch builder enters around forward and loss
    assert isinstance(context, torch.autocast) == wrap.autocast
    # A lower compute dtype is reached one way: FSDP2's policy or autocast, never both, never neither.
    lower = cfg.precision.compute_dtype != "fp32"
    assert (wrap.autocast or wrap.mixed_precision) == lower and not (wrap.autocast and wrap.mixed_precision)


def check_config(cfg) -> None:
    missing = unsupported(cfg.sharding, cfg.precision)
    if missing:
        pytest.skip("core/support.py: " + "; ".join(missing))
    wrap = wrapping_of(cfg.sharding, cfg.precision)
    check_precision_path(wrap, cfg)
    dims = ParallelDims.from_config(cfg.sharding)
    with fake_world(dims.world_size):
        mesh = build_mesh(dims, CPU)
        for part in build_parts(cfg, mesh):
            check_part(part, wrap, cfg, mesh)


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_wraps_as_decided(recipe):
    check_config(recipe_config(recipe))


@pytest.mark.parametrize(("strategy", "tp", "pp", "precision"), GRID, ids=["-".join(map(str, c)) for c in GRID])
def test_the_grid_wraps_as_decided(strategy, tp, pp, precision):
    try:
        cfg = grid_config(strategy, tp, pp, precision)
    except ConfigError as exc:  # a layout validation refuses is never handed to the worker
        pytest.skip(f"refused by validation: {exc}")
    check_config(cfg)
