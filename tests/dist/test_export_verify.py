"""`export --verify` (models/verify.py): transformers loads the export and its logits must equal trainctl's.

A deliberately broken conversion (a q/k weight without the rotary permutation, a layout mistake made the same way
in both directions of the name map, a tensor dropped from the file) is written by a hook, and each must be
refused: exit 1, one line naming the worst tensor or position, nothing at the output path. The same broken
exports without --verify exit 0: that is what the check is for. The hostile cases (no transformers, an existing
export folder, no checkpoint, a lost tokenizer record) are one line, exit 2, nothing written.
In process, but with the dist tier: importing transformers alone would cost the unit tier about 4 s.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from tests.unit.test_export import write_manifest
from trainctl.config.schema import ModelConfig, RunConfig, to_yaml
from trainctl.core import rundir as layout
from trainctl.models import export, hf
from trainctl.models.export import main
from trainctl.models.llama import build_model

pytest.importorskip("transformers")  # a dev dependency; --verify without it is tested below with find_spec faked
pytestmark = [pytest.mark.dist, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]
CFG = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=96, max_seq_len=64)
STEP = "step-00000004"


def save_run(root: Path, cfg: ModelConfig) -> Path:
    """A run with one committed checkpoint of random weights scaled so that activations are O(1) and attention is
    peaked: a mistake in the attention's layout then moves the logits by far more than the tolerance."""
    torch.manual_seed(0)
    model = build_model(cfg, "cpu")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif "embeddings" in name:
                param.normal_(0, 1)
            else:
                gain = 3 if ("wq" in name or "wk" in name) else 1
                param.normal_(0, gain / param.shape[1] ** 0.5)
    root.mkdir(parents=True)
    (root / "config.yaml").write_text(to_yaml(RunConfig(model=cfg)))
    ckpt = root / "checkpoints" / STEP
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt), no_dist=True)
    (ckpt / "meta.json").write_text(json.dumps({"step": 4}))
    write_manifest(ckpt, 4)
    return root


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    tied = replace(CFG, tie_embeddings=True)
    return {"untied": save_run(root / "untied", CFG), "tied": save_run(root / "tied", tied)}


@pytest.fixture
def run(saved, tmp_path):
    shutil.copytree(saved["untied"], tmp_path / "run")
    return tmp_path / "run"


def export_verify(run_dir: Path, out: Path, capsys, *extra: str) -> tuple[int, list[str], list[str]]:
    code = main([str(run_dir), "--out", str(out), *extra])
    captured = capsys.readouterr()
    return code, captured.out.strip().splitlines(), captured.err.strip().splitlines()


def assert_nothing_left(out: Path) -> None:
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp")]


@pytest.mark.parametrize(("kind", "dtype"), [("untied", "fp32"), ("tied", "bf16")])
def test_a_good_export_verifies(saved, tmp_path, capsys, kind, dtype):
    out = tmp_path / "out"
    code, lines, err = export_verify(saved[kind], out, capsys, "--verify", "--dtype", dtype)
    assert code == 0 and err == [], err
    assert lines[0].startswith("verified with transformers: no missing or unexpected keys, every tensor equal")
    difference = float(lines[0].split("max abs logits difference ")[1].split()[0])
    assert difference < 1e-4, lines[0]
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()


def forget_the_rotary_permutation(monkeypatch) -> None:
    """The commonest conversion bug: q and k written in trainctl's interleaved layout under transformers' names."""
    monkeypatch.setattr(export, "to_hf", lambda name, tensor, cfg: (hf.to_hf_name(name), tensor.contiguous()))


def test_q_and_k_without_the_rotary_permutation_are_refused_naming_the_worst_tensor(run, tmp_path, capsys,
                                                                                     monkeypatch):
    forget_the_rotary_permutation(monkeypatch)
    code, _, err = export_verify(run, tmp_path / "out", capsys, "--verify")
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith(f"error: verify: {tmp_path / 'out'}: model.layers."), err
    assert "_proj.weight as transformers loads it differs from the checkpoint's layers." in err[0]
    assert_nothing_left(tmp_path / "out")
    # Without --verify the same broken files are written and called done.
    assert export_verify(run, tmp_path / "unverified", capsys)[0] == 0


def test_a_layout_mistake_made_in_both_directions_is_caught_by_the_logits(run, tmp_path, capsys, monkeypatch):
    """Mapped back with the same (wrong) inverse, every tensor compares equal: only the logits can tell."""
    monkeypatch.setattr(hf, "to_hf_rows", lambda w, heads: w)
    monkeypatch.setattr(hf, "from_hf_rows", lambda w, heads: w)
    code, _, err = export_verify(run, tmp_path / "out", capsys, "--verify")
    assert code == 1 and len(err) == 1, err
    assert "transformers' logits differ from trainctl's by " in err[0], err
    assert "worst at sequence " in err[0] and "the first block whose output differs is layers.0" in err[0]
    assert_nothing_left(tmp_path / "out")


def test_a_tensor_missing_from_the_safetensors_is_refused(run, tmp_path, capsys, monkeypatch):
    """transformers fills a missing norm with ones and only logs it: garbage that loads."""
    write_weights = export.write_weights

    def drop_a_norm(ckpt, entries, names, out, *args, **kwargs):
        total = write_weights(ckpt, entries, names, out, *args, **kwargs)
        tensors = load_file(out / export.SINGLE_FILE)
        del tensors["model.layers.1.post_attention_layernorm.weight"]
        save_file(tensors, str(out / export.SINGLE_FILE), metadata={"format": "pt"})
        return total

    monkeypatch.setattr(export, "write_weights", drop_a_norm)
    code, _, err = export_verify(run, tmp_path / "out", capsys, "--verify")
    assert code == 1 and len(err) == 1, err
    assert err[0].endswith("transformers loads the export with missing keys "
                           "model.layers.1.post_attention_layernorm.weight"), err
    assert_nothing_left(tmp_path / "out")


def test_verify_without_transformers_is_one_line_before_anything_is_written(run, tmp_path, capsys, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else
                        find_spec(name, *a))
    code, _, err = export_verify(run, tmp_path / "out", capsys, "--verify")
    assert code == 2 and len(err) == 1 and "--verify: transformers is not installed in " in err[0], err
    assert_nothing_left(tmp_path / "out")
    assert not (run / "export").exists()


def test_verify_into_an_existing_export_leaves_it_as_it_was(run, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_text("someone's earlier export")
    code, _, err = export_verify(run, out, capsys, "--verify")
    assert code == 2 and err == [f"error: {out}: already exists and is not empty; remove it or pass --out DIR"]
    assert [p.name for p in out.iterdir()] == ["model.safetensors"]
    assert (out / "model.safetensors").read_text() == "someone's earlier export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run"]


def test_verify_of_a_run_without_a_checkpoint_is_one_line(run, tmp_path, capsys):
    shutil.rmtree(run / "checkpoints" / STEP)
    code, _, err = export_verify(run, tmp_path / "out", capsys, "--verify")
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: {run}: no committed checkpoint under "), err
    assert_nothing_left(tmp_path / "out")


def record_tokenizer(run_dir: Path) -> None:
    """What the launcher keeps for a run that trained with a Hugging Face tokenizer.json."""
    import hashlib

    folder = run_dir / layout.TOKENIZER
    folder.mkdir()
    data = json.dumps({"model": {"type": "BPE"}}).encode()
    (folder / "tokenizer.json").write_bytes(data)
    record = {"eos_id": 2, "files": {"tokenizer.json": hashlib.sha256(data).hexdigest()}}
    (run_dir / layout.TOKENIZER_RECORD).write_text(json.dumps(record))


@pytest.mark.parametrize("lost", ["record", "copy"])
def test_a_lost_tokenizer_record_or_copy_is_one_line_and_writes_nothing(run, tmp_path, capsys, lost):
    record_tokenizer(run)
    (run / (layout.TOKENIZER_RECORD if lost == "record" else f"{layout.TOKENIZER}/tokenizer.json")).unlink()
    code, _, err = export_verify(run, run / "export" / "x", capsys, "--verify")
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: {run / layout.TOKENIZER_RECORD if lost == 'record' else run / layout.TOKENIZER}")
    assert not (run / "export").exists()
