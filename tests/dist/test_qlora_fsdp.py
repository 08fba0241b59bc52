"""QLoRA (model.lora.base_dtype=nf4) under FSDP2 on CPU gloo: each rank holds its rows of the 4-bit base, cut from
the whole weight's quantization, so two ranks train the curve one process trains; the checkpoint holds the NF4 base
whole (as one process saves it), a stopped run resumes exactly, and the run exports as an adapter and merged.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from worker_runs import (
    TINY,
    assert_same_steps,
    base_config,
    check_worker,
    records,
    run_worker,
    train_many,
    write_run_dir,
)

from tests.faults.worker_faults import fault_env
from tests.helpers import ranks_cmd, run_group, tool_argv, worker_env
from trainctl.config.schema import LoRAConfig, OptimConfig, ShardingConfig
from trainctl.core import checkpoints
from trainctl.core.lora import quantized_base
from trainctl.core.tool_options import ExportOptions
from trainctl.models import export as export_module
from trainctl.models.checkpoint_reader import model_entries, read_tensors

pytest.importorskip("torchao")
pytestmark = pytest.mark.dist
STEPS = 8
# dim 128, ffn 256: gate, up and down are 128 x 256 = two NF4 scale-factor blocks each, one per rank.
QLORA = LoRAConfig(rank=4, alpha=8.0, dropout=0.0, targets=["gate", "up", "down"], base_dtype="nf4")
MODEL = replace(TINY, dim=128, ffn_dim=256, lora=QLORA)
FSDP = ShardingConfig(strategy="zero3", dp_shard=2)


def qlora_config(cache: Path, name: str, sharding: ShardingConfig, micro_batch: int, grad_accum: int):
    cfg = base_config(cache, steps=STEPS, micro_batch=micro_batch, grad_accum=grad_accum)
    return replace(cfg, name=name, model=MODEL, sharding=sharding, optim=OptimConfig(lr=1e-2))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache) -> dict[str, Path]:
    """One process and FSDP2 over 2 ranks, the same global batch of 8 (no dropout: its masks are drawn per rank)."""
    return train_many(tmp_path_factory.mktemp("qlora"), {
        "one": (qlora_config(data_cache, "one", ShardingConfig(strategy="none"), 4, 2), None),
        "fsdp": (qlora_config(data_cache, "fsdp", FSDP, 4, 1), 2),
    })


def saved_model(run_dir: Path) -> dict[str, torch.Tensor]:
    """The newest checkpoint's model tensors, the NF4 base dequantized (what export reads)."""
    ckpt = checkpoints.newest_valid(run_dir).path
    entries = model_entries(ckpt)
    return read_tensors(ckpt, entries, sorted(entries))


def test_fsdp_trains_one_process_curve_and_saves_its_nf4_base(runs):
    assert_same_steps(runs["fsdp"], runs["one"], "loss", STEPS, model=MODEL)
    log = (runs["fsdp"] / "logs" / "rank0.log").read_text()
    assert "qlora:" in log and "NF4" in log
    one, fsdp = saved_model(runs["one"]), saved_model(runs["fsdp"])
    assert one.keys() == fsdp.keys()
    base = [n for n in one if quantized_base(n, QLORA)]
    assert len(base) == MODEL.n_layers * 3
    # the same whole-tensor quantization of the same init: bitwise
    assert all(torch.equal(one[n], fsdp[n]) for n in base), [n for n in base if not torch.equal(one[n], fsdp[n])]


@pytest.mark.slow  # three torchruns: a straight run, a stop, a resume
def test_fsdp_resume_after_a_stop_equals_the_straight_run(tmp_path, data_cache):
    """The adapters, their AdamW states and dropout's RNG (on here) come back exactly; the NF4 base is read back
    whole and each rank takes its rows again. Both runs in fresh torchruns: compared bitwise."""
    cfg = qlora_config(data_cache, "straight", FSDP, 4, 1)
    cfg = replace(cfg, model=replace(MODEL, lora=replace(QLORA, dropout=0.1)))
    straight, resumed = (write_run_dir(tmp_path, replace(cfg, name=name)) for name in ("straight", "resumed"))
    check_worker(straight, run_worker(straight, 2))
    stop = run_group(ranks_cmd(2, "-m", "trainctl.train", str(resumed)), 240,
                     worker_env(**fault_env(stop_after_step=STEPS // 2)))
    check_worker(resumed, stop)
    assert [s for s, _ in checkpoints.list_committed(resumed / "checkpoints")] == [STEPS // 2]
    check_worker(resumed, run_worker(resumed, 2))
    loss = {r["step"]: r["loss"] for r in records(resumed, "train")}
    assert loss == {r["step"]: r["loss"] for r in records(straight, "train")}
    a, b = saved_model(straight), saved_model(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_fsdp_run_exports_adapter_and_merged(runs, tmp_path, capsys):
    for flag in ("--adapter", "--merged"):
        assert export_module.main(tool_argv(ExportOptions, [str(runs["fsdp"]), "--out", str(tmp_path / flag),
                                                            flag])) == 0, capsys.readouterr().err
    said = capsys.readouterr().out
    assert "dequantized" in said and "4-bit NF4 base" in said
    assert (tmp_path / "--adapter" / "adapter_model.safetensors").is_file()
    assert list((tmp_path / "--merged").glob("*.safetensors"))
