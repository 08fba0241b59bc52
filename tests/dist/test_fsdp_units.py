"""FSDP2 wrapping granularity: embedding, every block, norm + output, then the root (world of one)."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

from trainctl.config.schema import ModelConfig
from trainctl.models.build import build_model
from trainctl.train.parallel.parallelize import apply_fsdp

# A process group (a world of one, in this process): the dist tier, not unit.
pytestmark = pytest.mark.dist

SMALL = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)


@pytest.fixture(scope="module")
def mesh():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def _units(model) -> set[str]:
    return {name or "<root>" for name, m in model.named_modules() if isinstance(m, FSDPModule)}


def test_untied_model_gets_embedding_and_head_units(mesh):
    model = build_model(SMALL, "meta")
    apply_fsdp(model, mesh, reshard_after_forward=True, mp_policy=MixedPrecisionPolicy())
    assert _units(model) == {"<root>", "tok_embeddings", "layers.0", "layers.1", "norm", "output"}


def test_tied_embedding_stays_in_the_root(mesh):
    model = build_model(ModelConfig(**{**SMALL.__dict__, "tie_embeddings": True}), "meta")
    apply_fsdp(model, mesh, reshard_after_forward=True, mp_policy=MixedPrecisionPolicy())
    assert _units(model) == {"<root>", "layers.0", "layers.1"}
