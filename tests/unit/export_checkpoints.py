"""Real DCP checkpoints for the export tests: a run directory with committed checkpoints, the exporter's entry,
and the comparison of an export with the model's tensors. Shared by test_export*.py and the dist export tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from tests.helpers import tool_argv
from trainctl.config.load import to_yaml
from trainctl.config.schema import ModelConfig, RunConfig
from trainctl.core import model_record
from trainctl.core.checkpoints import MANIFEST, list_files, sha256
from trainctl.core.tool_options import ExportOptions
from trainctl.models import export as export_module
from trainctl.models.build import build_model
from trainctl.models.hf import from_hf

SMALL = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64)  # quick to save and hash
SHARD = "__0_0.distcp"


def main(args: list[str]) -> int:
    """The exporter's child entry on options written as a user types them: RUN_DIR --flag value ..."""
    return export_module.main(tool_argv(ExportOptions, args))


def write_manifest(ckpt: Path, step: int) -> None:
    """The manifest the worker commits: every other file's size and sha256 (re-hashing makes damage "valid")."""
    rels = [rel for rel in list_files(ckpt) if rel != MANIFEST]
    files = {rel: {"size": (ckpt / rel).stat().st_size, "sha256": sha256(ckpt / rel)} for rel in rels}
    (ckpt / MANIFEST).write_text(json.dumps({"step": step, "world_size": 1, "files": files}))


def make_run(root: Path, model_cfg: ModelConfig, steps: tuple[int, ...] = (5,)) -> dict[int, dict[str, torch.Tensor]]:
    """A run directory with one committed DCP checkpoint per step (model and optimizer, an optimizer step apart).

    Returns the model's tensors at each step.
    """
    torch.manual_seed(0)
    model = build_model(model_cfg, device="cpu")
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    root.mkdir(parents=True)
    (root / "config.yaml").write_text(to_yaml(RunConfig(model=model_cfg)))
    tensors = {}
    for step in steps:
        model(torch.zeros(1, 8, dtype=torch.long)).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        ckpt = root / "checkpoints" / f"step-{step:08d}"
        dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=str(ckpt), no_dist=True)
        (ckpt / "meta.json").write_text(json.dumps({"step": step, "model": model_record.record(model_cfg)}))
        write_manifest(ckpt, step)
        tensors[step] = {name: t.detach().clone() for name, t in model.state_dict().items()}
    return tensors


def as_trainctl(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """An export's Hugging Face tensors back under trainctl's names and rotary layout."""
    return dict(from_hf(name, t, cfg) for name, t in tensors.items())


def assert_same_tensors(exported: dict[str, torch.Tensor], original: dict[str, torch.Tensor],
                        cfg: ModelConfig | None = None) -> None:
    """The export holds exactly the model's tensors, bit for bit, in Hugging Face's names and layout."""
    assert all(name.startswith(("model.", "lm_head.")) for name in exported), sorted(exported)[:3]
    exported = as_trainctl(exported, cfg or ModelConfig())
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype, name
        assert torch.equal(exported[name], tensor), name


def flip_bytes(path: Path, count: int = 64) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + count] = bytes(b ^ 0xFF for b in data[middle:middle + count])
    path.write_bytes(bytes(data))
