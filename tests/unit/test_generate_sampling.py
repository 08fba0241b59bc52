"""generate's token choice (greedy, temperature, top-p as transformers' TopPLogitsWarper) and the run's tokenizer
for a run that recorded a Hugging Face tokenizer (eos ids from the record and generation_config.json)."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from trainctl.config.load import to_yaml
from trainctl.config.schema import DataConfig, RunConfig
from trainctl.core import rundir as layout
from trainctl.models.generate import Sampling, next_token
from trainctl.models.run_tokens import run_tokens


def draws(logits: torch.Tensor, sampling: Sampling, n: int = 400) -> set[int]:
    generator = torch.Generator().manual_seed(sampling.seed)
    return {next_token(logits, sampling, generator) for _ in range(n)}


def test_greedy_is_the_argmax():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert next_token(logits, Sampling(temperature=0.0), None) == 1


def test_top_p_keeps_the_smallest_set_that_reaches_p():
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps the first two, 0.85 the first three (as transformers)
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert draws(logits, Sampling(temperature=1.0, top_p=0.7)) == {0, 1}
    assert draws(logits, Sampling(temperature=1.0, top_p=0.85)) == {0, 1, 2}
    assert draws(logits, Sampling(temperature=1.0, top_p=1e-6)) == {0}
    assert draws(logits, Sampling(temperature=1.0)) == {0, 1, 2, 3}


def test_the_same_seed_draws_the_same_tokens():
    logits = torch.zeros(50)
    first = [next_token(logits, Sampling(temperature=1.0), g) for g in [torch.Generator().manual_seed(7)] * 20]
    again = [next_token(logits, Sampling(temperature=1.0), g) for g in [torch.Generator().manual_seed(7)] * 20]
    assert first == again and len(set(first)) > 1


@pytest.fixture
def hf_run(tmp_path):
    """A run directory that recorded a tokenizer.json and a generation_config.json (launch/tokenizer_record.py)."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"hello": 0, "world": 1, "<eos>": 2, "<eot>": 3},
                                                           unk_token="<eos>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    run = tmp_path / "run"
    (run / layout.TOKENIZER).mkdir(parents=True)
    data = DataConfig(kind="memmap", datasets=[str(tmp_path / "tok")])
    (run / "config.yaml").write_text(to_yaml(RunConfig(data=data)))
    tok.save(str(run / layout.TOKENIZER / "tokenizer.json"))
    (run / layout.TOKENIZER / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    files = {name: hashlib.sha256((run / layout.TOKENIZER / name).read_bytes()).hexdigest()
             for name in ("tokenizer.json", "generation_config.json")}
    (run / layout.TOKENIZER_RECORD).write_text(json.dumps({"eos_id": 2, "files": files}))
    return run


def test_a_recorded_hf_tokenizer_encodes_and_stops_at_every_eos(hf_run):
    tokens = run_tokens(hf_run)
    assert tokens.kind == "hf" and tokens.eos_ids == [2, 3]
    assert tokens.encode("hello world") == [0, 1]


@pytest.mark.parametrize("name, end", [("chatml", "<|im_end|>"), ("llama3", "<|eot_id|>")])
def test_chat_stops_at_the_templates_end_of_turn(tmp_path, name, end):
    """Byte tokens spell the end-of-turn marker out (no eos id for it): --chat stops at its text."""
    from trainctl.data.chat_template import load_template
    from trainctl.models.run_tokens import RunTokens

    (tmp_path / "meta.json").write_text(json.dumps({"chat_template": load_template(name, None).record()}))
    tokens = RunTokens("bytes", [0], dataset=tmp_path)
    assert tokens.end_of_turn() == end
    assert tokens.chat_prompt("hi").endswith("assistant\n" if name == "chatml" else "assistant<|end_header_id|>\n\n")


@pytest.mark.parametrize("text, want", [("Yes.<|im_end|>junk", "Yes."), ("Yes.<|im", "Yes."), ("Yes.<", "Yes."),
                                        ("Yes.", "Yes."), ("a < b", "a < b"), ("<|im_end", "")])
def test_a_completion_loses_the_end_marker_and_the_start_of_one_cut_short(text, want):
    """--max-new-tokens 8 stopped `Yes.` inside the byte-spelled `<|im_end|>`: the answer is `Yes.`, not `Yes.<|im`."""
    from trainctl.models.generate import without_end

    assert without_end(text, "<|im_end|>") == want
