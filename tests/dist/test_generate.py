"""`trainctl generate` and `trainctl eval` on a tiny run the worker trained on a chat set (random digit prompts,
one fixed answer, byte tokens, ChatML): greedy equals transformers' greedy on the export token for token, with
and without the KV cache; the cache's logits equal the full forward's for every family; sampling is reproducible
by --seed; eval's loss equals the worker's own val loss; user errors are one line, exit 2.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from worker_runs import base_config, records, train_many

from tests.helpers import assert_close_fp, curve_rel, forward_terms, run_cli, tool_argv
from tests.unit.export_checkpoints import write_manifest
from tests.unit.test_masked_loss import ANSWER, chat_set
from trainctl import api
from trainctl.config.load import to_yaml
from trainctl.config.schema import DataConfig, ModelConfig, RunConfig
from trainctl.core.tool_options import EvalResult, ExportOptions, GenerateOptions
from trainctl.models import export as export_module
from trainctl.models.build import build_model
from trainctl.models.generate import Sampling, generate_ids, load_model
from trainctl.models.kv_cache import KVCache, forward_cached

pytestmark = [pytest.mark.dist, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]
CPU = torch.device("cpu")
STEPS = 120


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache) -> tuple[dict[str, Path], Path]:
    """({"chat": a run trained until it answers ANSWER to any digit prompt, its last checkpoint and last eval
    coinciding; "bpe": a run on a BPE dataset of its own (test_text_prompt_...)}, the chat dataset): both trained in
    one interpreter (tests/dist/worker_runs.train_many)."""
    from trainctl.data.prepare import prepare

    root = tmp_path_factory.mktemp("generate")
    out = chat_set(root, records=300)
    cfg = base_config(data_cache, steps=STEPS, eval_every=STEPS, eval_batches=3)
    chat = replace(cfg, data=DataConfig(kind="memmap", datasets=[str(out)], vocab_size=256),
                   optim=replace(cfg.optim, lr=3e-3))
    cases = {"chat": (chat, None)}
    if importlib.util.find_spec("tokenizers") is not None:  # else the BPE test skips: no BPE run
        text = "".join(f"the cat number {i} sat on the mat and looked at the dog.\n" for i in range(400))
        (root / "cats.txt").write_text(text)
        prepare([str(root / "cats.txt")], root / "bpe", workers=1, val_fraction=0.1, train_tokenizer=True,
                vocab_size=300)
        cfg = base_config(data_cache, steps=30, eval_every=0)
        cases["bpe"] = (replace(cfg, data=DataConfig(kind="memmap", datasets=[str(root / "bpe")], vocab_size=300),
                                model=replace(cfg.model, vocab_size=300), optim=replace(cfg.optim, lr=3e-3)), None)
    return train_many(root, cases), out


@pytest.fixture(scope="module")
def trained(runs) -> tuple[Path, Path]:
    return runs[0]["chat"], runs[1]


def export_main(args: list[str]) -> int:
    """The exporter's child entry on options written as a user types them: RUN_DIR --flag value ..."""
    return export_module.main(tool_argv(ExportOptions, args))


def chat_prompt(digits: str) -> list[int]:
    return list(f"<|im_start|>user\n{digits}<|im_end|>\n<|im_start|>assistant\n".encode())


def test_greedy_equals_transformers_on_the_export_with_and_without_the_cache(trained, tmp_path):
    transformers = pytest.importorskip("transformers")
    run_dir, _ = trained
    assert export_main([str(run_dir), "--out", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    model, _ = load_model(run_dir, None, CPU)
    # Two chat prompts (the answer is learnt) and one cut mid-prompt (the model is unsure: near-ties are likely).
    for prompt in (chat_prompt("7"), chat_prompt("31415"), list(b"<|im_start|>user\n12")):
        new = 64 - len(prompt)  # to the end of the context (model.max_seq_len)
        want = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new, min_new_tokens=new,
                           pad_token_id=0)[0, len(prompt):].tolist()
        sampling = Sampling(max_new_tokens=new)
        assert generate_ids(model, prompt, sampling, []) == want
        assert generate_ids(model, prompt, sampling, [], use_cache=False) == want
        if prompt[-1] == ord("\n"):  # trained: the comparison is not of noise
            assert bytes(want) == ANSWER.encode()[:new], bytes(want)


@pytest.mark.parity
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_cached_logits_equal_the_full_forward_for_every_family(tmp_path, family):
    """fp32, prefill then single tokens then a chunk; weights perturbed so that q/k norms and biases matter."""
    cfg = ModelConfig(family=family, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256,
                      max_seq_len=64)
    torch.manual_seed(0)
    model = build_model(cfg, "cpu")
    model.init_weights()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.3)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(to_yaml(RunConfig(model=cfg)))
    ckpt = run_dir / "checkpoints" / "step-00000001"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt), no_dist=True)
    write_manifest(ckpt, 1)
    loaded, _ = load_model(run_dir, None, CPU)
    tokens = torch.randint(0, 256, (1, 40))
    with torch.no_grad():
        full = model(tokens)
        exact = copy.deepcopy(model).double()(tokens)  # float64: the exact result as far as fp32 can tell
    cache = KVCache()
    pieces = [forward_cached(loaded, tokens[:, a:b], cache) for a, b in ((0, 11), (11, 12), (12, 13), (13, 40))]
    # The cache sums keys in other chunks than the full forward: each fp32 side is held to rounding's bound
    # against the float64 forward (a wrong position or a stale key is off by the logits' own size).
    terms = forward_terms(cfg, tokens.shape[1])
    assert_close_fp(torch.cat(pieces, dim=1), exact, torch.float32, terms, sides=1, what=f"{family} cached")
    assert_close_fp(full, exact, torch.float32, terms, sides=1, what=f"{family} full forward")
    prompt = tokens[0, :5].tolist()
    assert generate_ids(loaded, prompt, Sampling(30), []) == generate_ids(loaded, prompt, Sampling(30), [],
                                                                           use_cache=False)
    greedy = generate_ids(loaded, prompt, Sampling(30), [])
    assert generate_ids(loaded, prompt, Sampling(30), [greedy[4]])[-1] == greedy[4]  # stops at an eos id
    assert generate_ids(loaded, prompt, Sampling(30), [], stop=lambda new: len(new) == 3) == greedy[:3]


def test_sampling_is_reproducible_by_seed(trained):
    run_dir, _ = trained
    model, _ = load_model(run_dir, None, CPU)
    prompt = list(b"<|im_start|>user\n")
    runs = {seed: generate_ids(model, prompt, Sampling(30, temperature=3.0, top_p=0.95, seed=seed), [])
            for seed in (1, 1, 2)}
    again = generate_ids(model, prompt, Sampling(30, temperature=3.0, top_p=0.95, seed=1), [])
    assert runs[1] == again and runs[1] != runs[2]


def test_eval_loss_equals_the_workers_val_loss(trained, capsys):
    """Through the api: the options go to the torch child as JSON, its result comes back as a value."""
    run_dir, out = trained
    worker = records(run_dir, "eval")[-1]
    assert worker["step"] == STEPS
    result = api.evaluate(run_dir, data=str(out))
    assert isinstance(result, EvalResult) and capsys.readouterr().out == ""  # a value, nothing printed
    assert result.step == STEPS and result.batches == 3
    assert result.loss == pytest.approx(worker["val_loss"], rel=curve_rel(0, batch=3 * 8))  # its batches, re-summed
    # the masks are honoured: counting the random digit prompts would put the loss near log(10)
    assert result.loss < 0.1 and result.tokens < 3 * 8 * 64 / 2


def test_eval_all_scores_every_counted_token_of_the_split_once(trained, tmp_path):
    """--all over the chat set's val split: every target its mask counts, once; a text file is read whole."""
    from trainctl.data.format import LOSS, read_meta

    run_dir, out = trained
    meta = read_meta(out)
    flags = b"".join((meta.root / shard.mask).read_bytes() for shard in meta.splits["val"].shards)
    counted = sum(1 for f in flags[1:] if f & LOSS)  # the first token is no one's target
    result = api.evaluate(run_dir, data=str(out), full=True)
    assert (result.tokens, result.split_tokens, result.full_pass) == (counted, meta.splits["val"].tokens, True)
    assert result.loss < 0.1  # the answers it learned, now all of them
    text = "12 34\nno digits here, and then some more plain text\n"
    (tmp_path / "plain.txt").write_text(text)
    whole = api.evaluate(run_dir, data=str(tmp_path / "plain.txt"))
    # byte tokens: every byte and the document's end token, each after the one before it
    assert (whole.tokens, whole.split_tokens, whole.full_pass) == (len(text.encode()), len(text.encode()) + 1, True)


def test_generate_and_eval_through_the_cli(trained, tmp_path):
    run_dir, out = trained
    proc = run_cli("generate", str(run_dir), "--prompt", "7", "--chat", "--max-new-tokens", "30", timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "--max-new-tokens 30 cut to 13" in proc.stderr  # model.max_seq_len=64 leaves room for 13
    assert proc.stdout == ANSWER[:13] + "\n" and proc.probe["heavy"] == []  # the CLI itself never imported torch
    proc = run_cli("eval", str(run_dir), "--data", str(out), timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith(f"step {STEPS}: val loss "), proc.stderr
    proc = run_cli("generate", str(run_dir), "--prompt-ids", "1,2", "--max-new-tokens", "3", "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr
    [completion] = json.loads(proc.stdout)["completions"]
    assert completion["prompt"] == "1,2" and len(completion["ids"]) <= 3
    # A file whose second line cannot fit model.max_seq_len=64: both lines printed, then exit 1.
    (tmp_path / "prompts.txt").write_text("7\n" + "x" * 100 + "\n")
    proc = run_cli("generate", str(run_dir), "--prompts", str(tmp_path / "prompts.txt"), "--max-new-tokens", "3",
                   timeout=300)
    answers = [json.loads(line) for line in proc.stdout.splitlines()]
    assert proc.returncode == 1, proc.stderr
    assert [a["prompt"][:1] for a in answers] == ["7", "x"] and "error" not in answers[0]
    assert "line 2" in answers[1]["error"] and "1 of 2 prompts not answered" in proc.stderr


def test_eval_refuses_a_dataset_of_another_tokenizer(trained, tmp_path):
    pytest.importorskip("tokenizers")
    from trainctl.data.prepare import prepare

    run_dir, _ = trained
    (tmp_path / "t.txt").write_text("some text to learn a tokenizer from\n" * 200)
    prepare([str(tmp_path / "t.txt")], tmp_path / "bpe", workers=1, val_fraction=0.2, train_tokenizer=True,
            vocab_size=300)
    proc = run_cli("eval", str(run_dir), "--data", str(tmp_path / "bpe"), timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "tokenized with another tokenizer than the run's" in lines[0]


def test_user_errors_are_one_line_and_exit_2(trained, tmp_path):
    run_dir, _ = trained
    (tmp_path / "empty.txt").write_text("\n  \n")
    os.mkfifo(tmp_path / "fifo")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.yaml").write_text((run_dir / "config.yaml").read_text())
    cases = {
        "no run": (["generate", str(tmp_path / "nope"), "--prompt", "x"], "no run "),
        "no checkpoint": (["generate", str(bare), "--prompt", "x"], "no committed checkpoint"),
        "empty prompt file": (["generate", str(run_dir), "--prompts", str(tmp_path / "empty.txt")], "no prompt in it"),
        "fifo": (["generate", str(run_dir), "--prompts", str(tmp_path / "fifo")], "not a regular file"),
        "two prompts": (["generate", str(run_dir), "--prompt", "x", "--prompts", str(tmp_path / "empty.txt")],
                        "exactly one of"),
        "eval without a val split": (["eval", str(run_dir), "--data", str(tmp_path)], "not a prepared dataset"),
        "eval of no such path": (["eval", str(run_dir), "--data", str(tmp_path / "nope")], "no such file or folder"),
    }
    for name, (args, message) in cases.items():
        proc = run_cli(*args, timeout=300)  # a FIFO never opened: this returns instead of blocking
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], (name, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_text_prompt_with_the_runs_bpe_tokenizer_equals_transformers(runs, tmp_path, capsys):
    """The text path end to end: a BPE dataset, the worker, the export's tokenizer and model in transformers."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    run_dir = runs[0]["bpe"]
    assert export_main([str(run_dir), "--out", str(tmp_path / "hf")]) == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    prompt = "the cat number 7"
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    want = hf.generate(ids, do_sample=False, max_new_tokens=20, pad_token_id=tokenizer.eos_token_id)[0, ids.shape[1]:]
    capsys.readouterr()
    from trainctl.models.generate import main as generate_main

    args = [str(run_dir), "--prompt", prompt, "--max-new-tokens", "20", "--device", "cpu"]
    assert generate_main(tool_argv(GenerateOptions, args)) == 0
    shown = [t for t in want.tolist() if t != tokenizer.eos_token_id]
    assert capsys.readouterr().out == tokenizer.decode(shown) + "\n"
    assert "sat" in tokenizer.decode(shown)  # trained: the comparison is not of noise
