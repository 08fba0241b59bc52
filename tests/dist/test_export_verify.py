"""`export --verify`: the export is loaded with transformers and compared with the checkpoint before it is done.

In one process on real DCP checkpoints (tests/unit/export_checkpoints.py's make_run). A corrupted conversion (q rows in
the wrong rotary order, a config that computes another model) is caught and named; a failed check leaves nothing
at --out and exits 1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")
from tests.helpers import tool_argv  # noqa: E402
from tests.unit.export_checkpoints import SMALL, make_run, write_manifest  # noqa: E402  (real DCP checkpoints)
from trainctl.core.tool_options import ExportOptions  # noqa: E402
from trainctl.models import export as export_module  # noqa: E402
from trainctl.models.verify import VerifyError, verify_export  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def export_main(args: list[str]) -> int:
    """The exporter's child entry on options written as a user types them (without a result file it prints)."""
    return export_module.main(tool_argv(ExportOptions, args))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify") / "run"
    tensors = make_run(root, SMALL)
    return root, tensors[5]


@pytest.mark.parametrize("dtype", [None, "bf16"])
def test_a_good_export_is_verified(run, tmp_path, capsys, dtype):
    root, _ = run
    args = [str(root), "--out", str(tmp_path / "out"), "--verify"] + (["--dtype", dtype] if dtype else [])
    assert export_main(args) == 0
    out = capsys.readouterr().out
    assert "verified: transformers loads it as LlamaForCausalLM with no missing or unexpected keys" in out
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_q_rows_in_the_wrong_rotary_order_are_named(run, tmp_path):
    root, weights = run
    assert export_main([str(root), "--out", str(tmp_path / "out")]) == 0
    file = tmp_path / "out" / "model.safetensors"
    tensors = load_file(file)
    name = "model.layers.1.self_attn.q_proj.weight"
    heads, rows = SMALL.n_heads, tensors[name].shape[0]
    # The mistake converters make: the rows left in trainctl's interleaved order instead of HF's halves.
    tensors[name] = tensors[name].reshape(heads, 2, rows // heads // 2, -1).transpose(1, 2).reshape(rows, -1).clone()
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(VerifyError, match="q_proj.weight: differs from the checkpoint's layers.1.attention.wq.weight"):
        verify_export(tmp_path / "out", weights, SMALL, None)


def test_a_config_that_computes_another_model_is_caught_at_the_logits(run, tmp_path):
    root, weights = run
    assert export_main([str(root), "--out", str(tmp_path / "out")]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    config["hidden_act"] = "relu"  # every tensor still equal: only the computation differs
    (tmp_path / "out" / "config.json").write_text(json.dumps(config))
    with pytest.raises(VerifyError, match="logits differ from trainctl's"):
        verify_export(tmp_path / "out", weights, SMALL, None)


def test_a_failed_check_leaves_nothing_and_exits_1(run, tmp_path, capsys, monkeypatch):
    root, _ = run

    def mismatch(*args, **kwargs):
        raise VerifyError("logits differ (a stand-in for a wrong conversion)")

    monkeypatch.setattr(export_module, "verify_export", mismatch)
    assert export_main([str(root), "--out", str(tmp_path / "out"), "--verify"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: export --verify failed, nothing written: logits differ (a stand-in for a wrong conversion)"]
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_without_transformers_verify_says_so(run, tmp_path, monkeypatch):
    root, weights = run
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    with pytest.raises(VerifyError, match="pip install transformers"):
        verify_export(tmp_path, weights, SMALL, torch.float32)


def record_tokenizer(run_dir: Path) -> None:
    """What the launcher keeps for a run that trained with a Hugging Face tokenizer.json (launch/tokenizer_record)."""
    import hashlib

    from trainctl.core import rundir as layout

    folder = run_dir / layout.TOKENIZER
    folder.mkdir()
    data = json.dumps({"model": {"type": "BPE"}}).encode()
    (folder / "tokenizer.json").write_bytes(data)
    record = {"eos_id": 2, "files": {"tokenizer.json": hashlib.sha256(data).hexdigest()}}
    (run_dir / layout.TOKENIZER_RECORD).write_text(json.dumps(record))


@pytest.mark.parametrize("lost", ["record", "copy"])
def test_a_lost_tokenizer_record_or_copy_is_one_line_and_writes_nothing(run, tmp_path, capsys, lost):
    """Without its record the copies cannot be vouched for: no silent fallback to the dataset's tokenizer."""
    import shutil

    from trainctl.core import rundir as layout

    root = tmp_path / "run"
    shutil.copytree(run[0], root)
    record_tokenizer(root)
    (root / (layout.TOKENIZER_RECORD if lost == "record" else f"{layout.TOKENIZER}/tokenizer.json")).unlink()
    assert export_main([str(root), "--verify"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    named = root / layout.TOKENIZER_RECORD if lost == "record" else root / layout.TOKENIZER / "tokenizer.json"
    assert err[0].startswith(f"error: {named}: missing"), err
    assert not (root / "export").exists()


def save_peaked_run(root: Path, cfg) -> None:
    """A run with one committed checkpoint whose random q/k weights are large: attention is sharp, so rounding
    between two correct implementations grows past 1e-4 of the logit scale (measured 3.5e-4)."""
    import torch.distributed.checkpoint as dcp

    from trainctl.config.load import to_yaml
    from trainctl.config.schema import RunConfig
    from trainctl.models.build import build_model

    torch.manual_seed(0)
    model = build_model(cfg, "cpu")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif "embeddings" in name:
                param.normal_(0, 1)
            else:
                param.normal_(0, (4 if ("wq" in name or "wk" in name) else 1) / param.shape[1] ** 0.5)
    root.mkdir(parents=True)
    (root / "config.yaml").write_text(to_yaml(RunConfig(model=cfg)))
    ckpt = root / "checkpoints" / "step-00000004"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt), no_dist=True)
    write_manifest(ckpt, 4)


def test_rounding_in_a_deep_sharp_model_is_not_called_a_mismatch(tmp_path, capsys):
    """A correct export whose fp32 logits differ by 3.5e-4 of their scale (rounding, amplified by 8 sharp blocks)
    is verified; a wrong conversion is off by 1e-3 to O(1) (the tests above)."""
    from trainctl.config.schema import ModelConfig

    cfg = ModelConfig(dim=128, n_layers=8, n_heads=4, n_kv_heads=2, ffn_dim=336, vocab_size=2048, max_seq_len=128)
    save_peaked_run(tmp_path / "run", cfg)
    assert export_main([str(tmp_path / "run"), "--out", str(tmp_path / "out"), "--verify"]) == 0, \
        capsys.readouterr().err
    assert "verified: transformers loads it as LlamaForCausalLM" in capsys.readouterr().out
