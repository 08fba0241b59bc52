"""The worker's door to the families: the module and parallel plan of `model.family` (torch side).

The launcher side asks trainctl/models/registry.py (torch-free specs) instead.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch
from torch import nn

from trainctl.config.schema import ModelConfig


def family_module(cfg: ModelConfig) -> ModuleType:
    """trainctl/models/<family>/model.py: its MODEL class (built from a ModelConfig) and the module classes."""
    return importlib.import_module(f"trainctl.models.{cfg.family}.model")


def family_parallel(cfg: ModelConfig) -> ModuleType:
    """trainctl/models/<family>/parallel.py: root_plan, block_plan, fsdp_units, build_stage_model."""
    return importlib.import_module(f"trainctl.models.{cfg.family}.parallel")


def build_model(cfg: ModelConfig, device="meta") -> nn.Module:
    """The family's model on `device` (meta by default: shapes only, no memory, no init), with model.lora's
    adapters when its rank is positive (models/lora.py; the base weights are then frozen)."""
    from trainctl.models.lora import apply_lora

    with torch.device(device):
        model = family_module(cfg).MODEL(cfg)
    return apply_lora(model, cfg.lora)
