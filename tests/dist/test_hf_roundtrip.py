"""Hugging Face -> trainctl -> Hugging Face for every family, and imported weights' logits in every layout.

A family is one row of HF_CONFIGS: the transformers config of a tiny random model. For each row:
- round trip: the random model is saved, a run starts from it (model=hf, checkpoint.init_from) and trains
  3 steps, `trainctl export --verify` writes it; transformers loads the export with no missing, unexpected
  or mismatched keys, its fp32 logits equal the trained checkpoint's in trainctl within TOL, and its greedy
  `generate` gives the tokens trainctl's own greedy decoding gives;
- parity: the saved folder loaded in one process, and on 2 ranks (torchrun, gloo) under DDP, FSDP2, TP 2 and
  the two stages of sharding.pp=2 (through the schedule's forward pass), gives AutoModelForCausalLM's logits
  within TOL.
A row whose feature trainctl still refuses ("... is not implemented") is skipped, naming the refusal.
tests/dist/test_hf_families.py keeps the qwen2/qwen3/mistral table; these rows could join it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.dist.test_hf import SHAPES, TOL, WORKER, save_random_model, trainctl, trained_weights
from tests.helpers import run_torchrun

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.dist, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32}  # below the test's positions: the scaling shows
# family -> its tiny random model's transformers config. The qwen2, qwen3 and mistral rows come with their families.
HF_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SHAPES["gqa"]),
    "llama3": lambda: transformers.LlamaConfig(**SHAPES["gqa"], rope_scaling=LLAMA3_SCALING),
}
NEW_TOKENS = 6


def save_family(folder: Path, family: str, seed: int) -> transformers.PreTrainedModel:
    """The family's random model saved in `folder`; skipped while trainctl refuses its config as unimplemented."""
    from trainctl.config.hf_config import HFConfigError, model_fields

    model = save_random_model(folder, HF_CONFIGS[family](), seed)
    try:
        model_fields(folder)
    except HFConfigError as exc:
        if "is not implemented" not in str(exc):
            raise
        pytest.skip(f"trainctl refuses {family}: {exc}")
    return model


def greedy_trainctl(model: torch.nn.Module, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy decoding with trainctl's model: the whole sequence again for every new token (no KV cache)."""
    tokens = prompt
    with torch.no_grad():
        for _ in range(steps):
            tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens


@pytest.mark.slow
@pytest.mark.parametrize("family", list(HF_CONFIGS))
def test_round_trip_trains_exports_verified_and_generates(family, tmp_path):
    from trainctl.config.schema import load_run_config
    from trainctl.models.build import build_model

    source = tmp_path / "source"
    source_model = save_family(source, family, seed=3)
    launch = trainctl("launch", "model=hf", f"model.path={source}", f"checkpoint.init_from={source}",
                      "data=synthetic", "sharding=fsdp", "cluster.procs_per_node=2", "train.steps=3",
                      "train.seq_len=32", "train.global_batch=4", "train.micro_batch=2", "train.eval_every=0",
                      "schedule.warmup_steps=1", "logging.progress=false", "--name", "rt", cwd=tmp_path)
    assert launch.returncode == 0, launch.stdout[-3000:] + launch.stderr[-3000:]
    run_dir, out = tmp_path / "runs" / "rt", tmp_path / "exported"
    exported = trainctl("export", str(run_dir), "--out", str(out), "--verify", "--max-shard-size", "200KB",
                        cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    assert (out / "model.safetensors.index.json").is_file()  # verify follows the index as inference tools do
    assert ("verified: transformers loads it as LlamaForCausalLM with no missing or unexpected keys; every tensor "
            "matches the checkpoint") in exported.stdout

    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert all(not info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    model = model.float().eval()
    cfg = load_run_config(run_dir).model
    ours = build_model(cfg, "cpu").eval()
    ours.load_state_dict(trained_weights(run_dir, cfg), strict=not cfg.tie_embeddings)
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = model(tokens).logits
        diff = (theirs - ours(tokens)).abs().max().item()
        moved = (source_model(tokens).logits - theirs).abs().max().item()
    assert diff <= TOL, f"{family}: exported logits differ from the checkpoint's by {diff:.3g}"
    assert moved > 1e-3, "the export is the source model, not the trained one"
    generated = model.generate(tokens[:1, :5], max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 5 + NEW_TOKENS)
    assert torch.equal(generated, greedy_trainctl(ours, tokens[:1, :5], NEW_TOKENS)), family


@pytest.fixture(scope="module", params=list(HF_CONFIGS))
def hf_family(request, tmp_path_factory):
    """(family, its saved random model's folder, fixed tokens, transformers' logits for them)."""
    folder = tmp_path_factory.mktemp(f"hf-{request.param}")
    model = save_family(folder, request.param, seed=5)
    tokens = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        return request.param, folder, tokens, model(tokens).logits


def one_process_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    from trainctl.config.hf_config import model_fields
    from trainctl.config.schema import ModelConfig
    from trainctl.models.hf import load_hf_weights
    from trainctl.models.build import build_model

    cfg = ModelConfig(**model_fields(folder))
    model = build_model(cfg, "meta").to_empty(device="cpu")
    model.init_weights()  # random: the loaded weights must replace all of it
    assert load_hf_weights(model, folder, cfg) == len(list(model.parameters()))
    with torch.no_grad():
        return model.eval()(tokens)


@pytest.mark.parametrize("layout", ["one", "ddp", "fsdp", "tp", "pp"])
def test_imported_logits_equal_transformers(hf_family, layout, tmp_path):
    """One process, then 2 ranks on gloo (tests/dist/hf_layout_worker.py): pp runs the schedule's forward."""
    family, folder, tokens, expected = hf_family
    if layout == "one":
        got = {"logits": one_process_logits(folder, tokens), "loaded": 1}
    else:
        torch.save(tokens, tmp_path / "tokens.pt")
        proc = run_torchrun(2, WORKER, str(folder), layout, str(tmp_path / "tokens.pt"), str(tmp_path / "out.pt"))
        assert proc.returncode == 0, proc.stderr[-4000:]
        got = torch.load(tmp_path / "out.pt")
    assert got["loaded"] > 0  # load_hf_weights refuses a rank with any parameter left unset
    diff = (got["logits"] - expected).abs().max().item()
    assert diff <= TOL, f"{family}/{layout}: max |logits - transformers'| = {diff:.3g}"
