"""Hugging Face weights of every family in and out, checked against the real `transformers` library.

In: a random model of each family (SHAPES: Llama with grouped-query attention, tied embeddings, llama3 RoPE
scaling; Qwen2 with q/k/v biases; Qwen3 with q/k norms and head_dim != hidden/heads; Mistral) saved by
save_pretrained is loaded by trainctl under DDP, FSDP2, HSDP, tensor parallelism and pipeline stages: its
logits equal transformers' in fp32. Out: a run started from it (model=hf, checkpoint.init_from) trains a few steps,
`trainctl export` writes a folder that AutoModelForCausalLM loads with no missing or unexpected keys,
whose logits equal the trained checkpoint's in trainctl, and which generates.
"""

from __future__ import annotations

import json
import re
from functools import partial
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from worker_runs import MANY_RUNS_WORKER, WORKER_TIMEOUT_S, check_worker

from tests.helpers import (
    forward_terms,
    ranks_cmd,
    rounding_rel,
    run_cli,
    run_group,
    run_ranks,
    tool_argv,
    worker_env,
)

transformers = pytest.importorskip("transformers")  # a dev dependency: installed by scripts/_setup.sh

pytestmark = pytest.mark.dist
WORKER = str(Path(__file__).with_name("hf_layout_worker.py"))
# name -> (model_type, transformers config): the families' distinguishing features at toy size.
SHAPES = {
    "gqa": ("llama", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=176, vocab_size=300, max_position_embeddings=128, rope_theta=500000.0,
                          rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "tied": ("llama", dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=8,
                           intermediate_size=128, vocab_size=256, max_position_embeddings=64, rope_theta=10000.0,
                           rms_norm_eps=1e-6, tie_word_embeddings=True)),
    # Llama 3.1/3.2's scaling with original context 16: positions of a 24-token sequence go past it.
    "llama3_rope": ("llama", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=176, vocab_size=300, max_position_embeddings=256,
                                  rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                  rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "qwen2": ("qwen2", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=176, vocab_size=300, max_position_embeddings=128, rope_theta=1e6,
                            rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "qwen3": ("qwen3", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=32, intermediate_size=128, vocab_size=300, max_position_embeddings=128,
                            rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "mistral": ("mistral", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                intermediate_size=176, vocab_size=300, max_position_embeddings=128, rope_theta=1e6,
                                rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=64)),
}


def logits_bound(shape: dict, expected: torch.Tensor) -> float:
    """How far two fp32 implementations' logits of the transformers config `shape` may differ by rounding alone
    (tests.helpers.rounding_rel over the forward's chain, relative to the logits' scale); a misplaced or misordered
    weight is off by the scale itself."""
    from trainctl.config.schema import ModelConfig

    cfg = ModelConfig(dim=shape["hidden_size"], n_layers=shape["num_hidden_layers"],
                      n_heads=shape["num_attention_heads"], n_kv_heads=shape["num_key_value_heads"],
                      ffn_dim=shape["intermediate_size"], vocab_size=shape["vocab_size"],
                      head_dim=shape.get("head_dim", 0))
    return rounding_rel(torch.float32, forward_terms(cfg, expected.shape[-2])) * expected.abs().max().item()


def randomized(model):
    """Norms and biases start at 1 and 0, so a misplaced or misordered one would not show: make them random."""
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif param_name.endswith(".bias"):
                param.uniform_(-0.5, 0.5)
    return model


def random_hf_model(name: str, seed: int = 0, **changes):
    """A transformers model of SHAPES[name] (with `changes` to its config) with random weights everywhere."""
    model_type, shape = SHAPES[name]
    return random_model(transformers.AutoConfig.for_model(model_type, **{**shape, **changes}), seed)


def random_model(config, seed: int = 0):
    torch.manual_seed(seed)
    return randomized(transformers.AutoModelForCausalLM.from_config(config).eval())


def save_random_model(folder: Path, config, seed: int = 0, **save) -> transformers.PreTrainedModel:
    """A random model of any family (its transformers config) saved as a Hugging Face folder."""
    model = random_model(config, seed)
    model.save_pretrained(folder, **save)
    return model


def save_random_llama(folder: Path, shape: dict, seed: int = 0, **save) -> transformers.LlamaForCausalLM:
    return save_random_model(folder, transformers.LlamaConfig(**shape), seed, **save)


def save_random(folder: Path, name: str, seed: int = 0, **save):
    model = random_hf_model(name, seed)
    model.save_pretrained(folder, **save)
    return model


_SAVED: dict[str, tuple] = {}


def saved(name: str, tmp_path_factory) -> tuple:
    """(name, folder, tokens, transformers' logits) of SHAPES[name]'s random model, saved once per session."""
    if name not in _SAVED:
        folder = tmp_path_factory.mktemp(f"hf-{name}")
        # The GQA model is saved in shards: the loader must follow the index.
        save = {"max_shard_size": "100KB"} if name == "gqa" else {}
        model = save_random(folder, name, **save)
        tokens = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            _SAVED[name] = (name, folder, tokens, model(tokens).logits)
    return _SAVED[name]


@pytest.fixture(scope="module", params=list(SHAPES))
def hf_llama(request, tmp_path_factory):
    return saved(request.param, tmp_path_factory)


# Every family in the layouts whose weight placement differs (FSDP2 shards, TP's column/row split of q/k/v and
# their biases and norms, pipeline stages through the real schedule); DDP and HSDP place whole tensors as FSDP2
# does per replica, so two families cover them.
LAYOUTS = [(name, layout) for name in SHAPES for layout in ("fsdp", "tp", "pp")] + \
          [(name, layout) for name in ("gqa", "qwen3") for layout in ("ddp", "hsdp")]


TEST_LAYOUTS = "test_imported_logits_equal_transformers_in_every_layout"


@pytest.fixture(scope="module")
def layout_logits(request, tmp_path_factory) -> tuple[dict[tuple[str, str], Path], object]:
    """({(name, layout): the worker's out.pt}, the ranks' process): every collected case of LAYOUTS in ONE start of 2 ranks
    (hf_layout_worker.py runs them one after another in one process group; all are 2 ranks), not one each."""
    wanted = {tuple(item.callspec.params[k] for k in ("name", "layout")) for item in request.session.items
              if getattr(item, "originalname", None) == TEST_LAYOUTS}
    cases = [case for case in LAYOUTS if case in wanted] or LAYOUTS
    root, args, outs = tmp_path_factory.mktemp("hf-layouts"), [], {}
    for name, layout in cases:
        _, folder, tokens, _ = saved(name, tmp_path_factory)
        torch.save(tokens, root / f"{name}-tokens.pt")
        outs[name, layout] = root / f"{name}-{layout}-out.pt"
        args += [str(folder), layout, str(root / f"{name}-tokens.pt"), str(outs[name, layout])]
    return outs, run_ranks(2, WORKER, *args, timeout=240 + 30 * len(cases))


@pytest.mark.parametrize(("name", "layout"), LAYOUTS)
def test_imported_logits_equal_transformers_in_every_layout(name, layout, layout_logits, tmp_path_factory):
    name, folder, tokens, expected = saved(name, tmp_path_factory)
    if name == "gqa":
        assert (folder / "model.safetensors.index.json").is_file()
    outs, proc = layout_logits
    # The cases run in order and the first failure ends the ranks: a case after it has no file either.
    assert outs[name, layout].is_file(), f"{name}/{layout}: no logits ({proc.returncode}):\n{proc.stderr[-4000:]}"
    # With every case's logits written, a failing exit is the ranks' teardown: still a failure.
    assert proc.returncode == 0 or not all(out.is_file() for out in outs.values()), proc.stderr[-4000:]
    got = torch.load(outs[name, layout])
    assert got["loaded"] > 0  # load_hf_weights refuses a rank with any parameter left unset
    diff, bound = (got["logits"] - expected).abs().max().item(), logits_bound(SHAPES[name][1], expected)
    assert diff <= bound, f"{name}/{layout}: max |logits - transformers'| = {diff:.3g} > {bound:.3g} (rounding)"


# Training and exporting through the CLI: longer than run_cli's default limit.
trainctl = partial(run_cli, timeout=600)


def trained_weights(run_dir: Path, cfg) -> dict[str, torch.Tensor]:
    """The newest checkpoint's model tensors by trainctl name, read with DCP (not through the export)."""
    from trainctl.core import checkpoints
    from trainctl.models.build import build_model

    ckpt = checkpoints.newest_valid(run_dir).path
    names = [n for n in build_model(cfg, "meta").state_dict() if not (cfg.tie_embeddings and n == "output.weight")]
    shapes = dict(build_model(cfg, "meta").state_dict())
    state = {"model": {n: torch.empty(shapes[n].shape) for n in names}}
    dcp_load(state, checkpoint_id=str(ckpt), no_dist=True)
    return state["model"]


def greedy_trainctl(model: torch.nn.Module, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy decoding with trainctl's model: the whole sequence again for every new token (no KV cache)."""
    tokens = prompt
    with torch.no_grad():
        for _ in range(steps):
            tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens


ROUND_TRIP_SHAPES = ["gqa", "llama3_rope", "qwen2", "qwen3", "mistral"]


@pytest.fixture(scope="module")
def round_trips(tmp_path_factory) -> tuple[dict[str, tuple], object]:
    """({shape: (the source model, its run directory)}, the ranks' process): every shape's run directory written as
    `trainctl launch` writes it (api.prepare_launch, model=hf from the source folder), then all five (2 ranks each)
    trained in ONE start of 2 ranks (many_runs_worker.py: each through the worker's own entry) instead of a launch each."""
    from trainctl import api

    root, runs = tmp_path_factory.mktemp("round-trip"), {}
    for shape in ROUND_TRIP_SHAPES:
        source = root / f"source-{shape}"
        source_model = save_random(source, shape, seed=3)
        prepared = api.prepare_launch(["model=hf", f"model.path={source}", f"checkpoint.init_from={source}",
                                       "data=synthetic", "sharding=fsdp", "cluster.procs_per_node=2",
                                       "train.steps=3", "train.seq_len=32", "train.global_batch=4",
                                       "train.micro_batch=2", "train.eval_every=0", "schedule.warmup_steps=1",
                                       "logging.progress=false", f"runs_dir={root / 'runs'}"], name=f"rt-{shape}")
        runs[shape] = source_model, prepared.run_dir
    dirs = [str(run_dir) for _, run_dir in runs.values()]
    proc = run_group(ranks_cmd(2, str(MANY_RUNS_WORKER), *dirs), WORKER_TIMEOUT_S * len(dirs), worker_env())
    return runs, proc


@pytest.mark.slow
@pytest.mark.parametrize("shape", ROUND_TRIP_SHAPES)
def test_hf_to_trainctl_to_hf_round_trip(round_trips, tmp_path, capsys, shape):
    """A Hugging Face folder trains 3 steps under FSDP2, exports (sharded, --verify) and loads in transformers
    with every key; its logits are the checkpoint's, not the source's, and greedy generation equals trainctl's."""
    from trainctl.config.load import load_run_config
    from trainctl.core.tool_options import ExportOptions
    from trainctl.models import export as export_module
    from trainctl.models.build import build_model
    from trainctl.models.registry import spec

    runs, proc = round_trips
    source_model, run_dir = runs[shape]
    if not (run_dir / "result.json").is_file():
        check_worker(run_dir, proc)  # fails, naming the exit code, the stderr and this run's logs
    # With every run trained, a failing exit is the ranks' teardown: still a failure.
    done = all((r / "result.json").is_file() for _, r in runs.values())
    assert proc.returncode == 0 or not done, proc.stderr[-4000:]
    source = run_dir.parent.parent / f"source-{shape}"
    assert re.search(rf"initialized \d+ tensors from {re.escape(str(source))}\n", proc.stdout), proc.stdout[-3000:]
    out = tmp_path / "exported"
    # The exporter's own entry in this process (test_export_cli.py runs it through the console script).
    capsys.readouterr()
    code = export_module.main(tool_argv(ExportOptions, [str(run_dir), "--out", str(out), "--verify",
                                                        "--max-shard-size", "200KB"]))
    exported = capsys.readouterr()
    assert code == 0, exported.err
    assert (out / "model.safetensors.index.json").is_file()  # verify follows the index as inference tools do
    cfg = load_run_config(run_dir).model
    architecture = spec(cfg.family).hf_architectures[0]
    assert (f"verified: transformers loads it as {architecture} with no missing or unexpected keys; every tensor "
            "matches the checkpoint") in exported.out

    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert all(not info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(model).__name__ == architecture
    model = model.float().eval()
    ours = build_model(cfg, "cpu").eval()
    ours.load_state_dict(trained_weights(run_dir, cfg), strict=not cfg.tie_embeddings)
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = model(tokens).logits
        diff = (theirs - ours(tokens)).abs().max().item()
        moved = (source_model(tokens).logits - theirs).abs().max().item()
    bound = logits_bound(SHAPES[shape][1], theirs)
    assert diff <= bound, f"{shape}: exported logits differ from the checkpoint's by {diff:.3g} > {bound:.3g}"
    assert moved > 1e-3, "the export is the source model, not the trained one"
    generated = model.generate(tokens[:1, :5], max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 11)
    assert torch.equal(generated, greedy_trainctl(ours, tokens[:1, :5], 6)), shape
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == SHAPES[shape][0] and config["num_key_value_heads"] == 2


def test_pipeline_stages_each_load_their_own_pieces(hf_llama):
    """Each pipeline rank holds some blocks (the first the embedding, the last the head) in a ModuleList."""
    from trainctl.config.hf_config import model_fields
    from trainctl.config.schema import ModelConfig
    from trainctl.models.hf import load_hf_weights
    from trainctl.train.parallel.pipeline import build_stage_model

    name, folder, tokens, expected = hf_llama
    cfg = ModelConfig(**model_fields(folder))
    cut = cfg.n_layers // 2
    stages = []
    for layers, first, last in ((range(0, cut), True, False), (range(cut, cfg.n_layers), False, True)):
        part = build_stage_model(cfg, layers, first=first, last=last).to_empty(device="cpu")
        part.init_weights()
        assert load_hf_weights(torch.nn.ModuleList([part]), folder, cfg) == len(list(part.parameters()))
        stages.append(part)
    with torch.no_grad():
        logits = stages[1](stages[0](tokens))
    assert (logits - expected).abs().max().item() <= logits_bound(SHAPES[name][1], expected), name


@pytest.mark.slow  # about 20 s on 2 shared cores: a launch and an export, each a fresh interpreter with torch
def test_a_hub_name_from_the_cache_trains_and_exports_with_its_commit(tmp_path):
    """model.path and checkpoint.init_from as a Hub name, offline, from a cache in huggingface_hub's layout: the
    run loads its weights, plan.json pins the commit, and the LoRA adapter's base is the Hub name at that commit."""
    commit = "c0ffee" + "0" * 34
    repo = tmp_path / "hub" / "models--org--tiny"
    save_random(repo / "snapshots" / commit, "gqa", seed=5)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    hub_env = {"HF_HUB_CACHE": tmp_path / "hub", "HF_HUB_OFFLINE": 1}
    launch = trainctl("launch", "model=hf", "model.path=org/tiny", "checkpoint.init_from=org/tiny", "data=synthetic",
                      "model.lora.rank=4", "cluster.procs_per_node=1", "train.steps=2", "train.seq_len=32",
                      "train.global_batch=2", "train.micro_batch=2", "train.eval_every=0", "schedule.warmup_steps=1",
                      "logging.progress=false", "--name", "hub", cwd=tmp_path, **hub_env)
    assert launch.returncode == 0, launch.stdout[-3000:] + launch.stderr[-3000:]
    assert "initialized" in launch.stdout and f"models--org--tiny/snapshots/{commit}" in launch.stdout
    run_dir = tmp_path / "runs" / "hub"
    pinned = json.loads((run_dir / "plan.json").read_text())["hub"]
    assert pinned == {key: {"name": "org/tiny", "revision": commit} for key in ("model.path", "checkpoint.init_from")}
    exported = trainctl("export", "hub", "--adapter", "--out", "adapter", cwd=tmp_path, **hub_env)
    assert exported.returncode == 0, exported.stderr
    adapter = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (adapter["base_model_name_or_path"], adapter["revision"]) == ("org/tiny", commit)
