"""What model a checkpoint holds (core/model_record.py): saved in meta.json, checked when a run resumes from it.

The worker's side (train/checkpoint/resume.py's check_model) on real DCP checkpoints saved in one process; the
readers' side (export, generate, eval) is in test_export.py.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch.distributed.checkpoint as dcp

from trainctl.config.schema import LoRAConfig, ModelConfig
from trainctl.core import model_record
from trainctl.models.build import build_model
from trainctl.train.checkpoint.resume import check_model
from trainctl.train.errors import WorkerConfigError

SMALL = ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32, vocab_size=64)
LORA = replace(SMALL, lora=LoRAConfig(rank=4))
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def saved(path, cfg: ModelConfig, record: bool = True):
    dcp.save({"model": build_model(cfg, "cpu").state_dict()}, checkpoint_id=str(path), no_dist=True)
    meta = {"step": 3, **({"model": model_record.record(cfg)} if record else {})}
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def test_the_record_keeps_what_changes_the_computation_only():
    moved = replace(SMALL, name="other", path="/elsewhere", max_seq_len=4096)
    assert model_record.differences(model_record.record(SMALL), moved) == []
    assert model_record.differences(model_record.record(LORA), replace(LORA, lora=LoRAConfig(rank=4, dropout=0.1))) \
        == []
    (line,) = model_record.differences(model_record.record(SMALL), replace(SMALL, rope_theta=5e5))
    assert line == "model.rope_theta=500000.0 (saved: 10000.0)"
    assert model_record.differences(None, SMALL) == []  # a checkpoint saved before the record: nothing to compare


def test_a_resume_under_an_edited_config_is_refused_naming_the_keys(tmp_path):
    ckpt = saved(tmp_path / "step-00000003", SMALL)
    check_model(ckpt, "all", SMALL)
    with pytest.raises(WorkerConfigError) as err:
        check_model(ckpt, "all", replace(SMALL, rope_theta=5e5, norm_eps=1e-6))
    assert "model.norm_eps=1e-06 (saved: 1e-05), model.rope_theta=500000.0 (saved: 10000.0)" in str(err.value)
    check_model(ckpt, "model", replace(SMALL, rope_theta=5e5))  # a new run from its weights may extend the context


@pytest.mark.parametrize("record", [True, False])  # the record, or (older checkpoints) the adapter tensors
def test_a_full_run_from_a_lora_runs_weights_is_refused_not_started_from_the_base(tmp_path, record):
    ckpt = saved(tmp_path / "step-00000003", LORA, record)
    for load_only in ("model", "model_optim"):
        with pytest.raises(WorkerConfigError) as err:
            check_model(ckpt, load_only, SMALL)
        assert "LoRA adapters" in str(err.value) and "--merged" in str(err.value) and "init_from" in str(err.value)
    check_model(ckpt, "model", LORA)  # keeping the adapters loads them
    check_model(saved(tmp_path / "full", SMALL, record), "model", LORA)  # adapters start fresh on full weights
