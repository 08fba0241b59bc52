"""A run keeps the tokenizer it trains with (issue 21): copies and their sha256 at run creation, used and checked by
export; a Hugging Face folder's tokenizer_config.json and generation_config.json come along as they were."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest

from trainctl import api
from trainctl.config.schema import CheckpointConfig, RunConfig
from trainctl.core import rundir as layout
from trainctl.launch import tokenizer_record
from trainctl.models import export
from trainctl.models.checkpoint_reader import ExportError
from trainctl.models.hf_folder import run_tokenizer, write_tokenizer


def hf_folder(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    tokenizer = {"added_tokens": [{"id": 2, "content": "</s>"}], "model": {"type": "BPE"}}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}", "eos_token": "</s>"}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    return folder


def test_the_run_records_a_hf_folders_tokenizer_files_and_export_uses_them(tmp_path):
    folder, run_dir = hf_folder(tmp_path), tmp_path / "run"
    run_dir.mkdir()
    cfg = replace(RunConfig(), checkpoint=CheckpointConfig(init_from=str(folder)))
    tokenizer_record.write(run_dir, cfg)
    (folder / "tokenizer.json").write_text("{}")  # the folder changes after the run started
    tokens = run_tokenizer(run_dir)
    out = tmp_path / "out"
    out.mkdir()
    write_tokenizer(tokens, cfg.model, out)
    assert json.loads((out / "tokenizer.json").read_text())["model"] == {"type": "BPE"}  # the recorded copy
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == "{{ messages }}"
    assert (out / "generation_config.json").is_file()


def test_a_changed_copy_is_refused_by_export(tmp_path):
    folder, run_dir = hf_folder(tmp_path), tmp_path / "run"
    run_dir.mkdir()
    tokenizer_record.write(run_dir, replace(RunConfig(), checkpoint=CheckpointConfig(init_from=str(folder))))
    (run_dir / layout.TOKENIZER / "tokenizer.json").write_text("{}")
    with pytest.raises(ExportError, match="changed since the run started"):
        run_tokenizer(run_dir)


def test_a_fifo_among_the_tokenizer_files_is_left_out_not_waited_on(tmp_path):
    folder, run_dir = hf_folder(tmp_path), tmp_path / "run"
    run_dir.mkdir()
    os.unlink(folder / "generation_config.json")
    os.mkfifo(folder / "generation_config.json")
    tokenizer_record.write(run_dir, replace(RunConfig(), checkpoint=CheckpointConfig(init_from=str(folder))))
    record = json.loads((run_dir / layout.TOKENIZER_RECORD).read_text())
    assert sorted(record["files"]) == ["tokenizer.json", "tokenizer_config.json"]


def test_the_clis_export_dtypes_are_the_exporters():
    assert set(api.EXPORT_DTYPES) == set(export.EXPORT_DTYPES)
