"""QLoRA (model.lora.base_dtype=nf4): torchao's NF4 base under the adapters, in one process.

The forward equals the dequantized base plus the adapters; the plan's bytes are the live NF4 tensors'; a checkpoint
holding the NF4 base exports to a PEFT adapter that peft loads on the full-precision base with no key left over,
and to merged weights (the dequantized base plus the adapters) that compute the trained forward.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.helpers import assert_close_fp, forward_terms, tool_argv
from trainctl.config.compose import compose
from trainctl.config.errors import ConfigError
from trainctl.config.load import to_yaml
from trainctl.config.schema import LoRAConfig, ModelConfig, RunConfig, ShardingConfig
from trainctl.config.validate import resolve
from trainctl.core import model_record, nf4
from trainctl.core.checkpoints import MANIFEST, list_files, sha256
from trainctl.core.dims import ParallelDims
from trainctl.core.tool_options import ExportOptions
from trainctl.models import export as export_module
from trainctl.models import qlora
from trainctl.models.build import build_model
from trainctl.models.hf import to_hf
from trainctl.models.lora import LoRALinear, init_adapters
from trainctl.plan.rank_states import model_states
from trainctl.plan.stages import rank_stages
from trainctl.train.observe.memory_stats import tensor_bytes

torchao = pytest.importorskip("torchao")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
# dim 128 with as many kv heads as heads: every attention projection is 128 x 128 = one NF4 scale-factor block.
SHAPE = dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=256, vocab_size=128, max_seq_len=64)
QLORA = LoRAConfig(rank=4, alpha=8.0, targets=["q", "k", "v", "o", "up"], base_dtype="nf4")
CFG = ModelConfig(**SHAPE, lora=QLORA)


def _model(cfg: ModelConfig = CFG, quantize: bool = True) -> torch.nn.Module:
    """The base initialized, the adapters' B made non-zero (a trained adapter), the base then quantized."""
    torch.manual_seed(0)
    model = build_model(cfg, "cpu")
    model.init_weights()
    init_adapters(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".lora_b"):
                p.normal_(std=0.05)
    if quantize:
        assert qlora.quantize_base(model, cfg.lora) == cfg.n_layers * len(cfg.lora.targets)
    return model


def test_block_sizes_are_torchaos_defaults():
    """The plan's sizes are the ones torchao's to_nf4 (and torchtune, which calls it with its defaults) uses."""
    _, to_nf4 = qlora.torchao_nf4()
    defaults = inspect.signature(to_nf4).parameters
    assert (defaults["block_size"].default, defaults["scaler_block_size"].default) == (nf4.BLOCK, nf4.SCALER_BLOCK)


@pytest.mark.parametrize("shape", [(128, 128), (256, 128), (704, 256)])
def test_nf4_bytes_formula_equals_the_live_tensor(shape):
    weight = qlora.quantize(torch.randn(shape))
    assert qlora.is_nf4(weight)
    assert tensor_bytes(weight) == nf4.tensor_bytes(shape[0] * shape[1])
    assert nf4.tensor_bytes(shape[0] * shape[1]) < shape[0] * shape[1] * 4 / 7  # 4 bits + scales, not 32


def test_only_the_adapted_weights_are_quantized_and_only_adapters_get_gradients():
    model = _model()
    quantized = {n for n, p in model.named_parameters() if qlora.is_nf4(p)}
    from trainctl.core.lora import quantized_base

    assert quantized == {n for n, _ in model.named_parameters() if quantized_base(n, CFG.lora)}
    assert all(isinstance(m, LoRALinear) for n, m in model.named_modules() if f"{n}.weight" in quantized)
    tokens = torch.randint(0, 128, (2, 16))
    model(tokens, targets=tokens).backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad and all(".lora_" in n for n in with_grad)


def dequantized_merged_model(model: torch.nn.Module) -> torch.nn.Module:
    """The plain model (no adapters) whose weights are the NF4 base dequantized in fp32 plus scale * B @ A."""
    from trainctl.models.lora_export import merge

    state = {n: qlora.dequantized(t).detach() for n, t in model.state_dict().items()}
    plain = build_model(dataclasses.replace(model.cfg, lora=LoRAConfig()), "cpu")
    plain.load_state_dict(merge(state, model.cfg.lora))
    return plain


@pytest.mark.parity
def test_forward_equals_the_dequantized_base_plus_the_adapters():
    """W_nf4 x + s B (A x) against (deq(W) + s B A) x in fp32: the NF4 side dequantizes to the same fp32 values, so
    only the rank's sum and the forward's chain round (tests.helpers); the unquantized model differs far more."""
    model = _model()
    tokens = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        ours = model(tokens)
        reference = dequantized_merged_model(model)(tokens)
        unquantized = dequantized_merged_model(_model(quantize=False))(tokens)
    terms = forward_terms(CFG, 16) + CFG.lora.rank
    assert_close_fp(ours, reference, torch.float32, terms, what="QLoRA against dequantized base + adapters")
    assert (ours - unquantized).abs().max() > 100 * (ours - reference).abs().max()  # the base really is 4-bit


def test_plan_counts_the_live_nf4_params_per_rank():
    """Per-rank parameter bytes (fp32 rest, NF4 adapted weights) equal the live model's, as memory_stats counts."""
    model = _model()
    sharding = ShardingConfig(strategy="ddp", dp_replicate=2)
    dims = ParallelDims.from_config(sharding)
    planned = model_states(CFG, sharding, dims, rank_stages(CFG, sharding, 1)[0], 0)
    assert planned["params_bytes"] == sum(tensor_bytes(p) for p in model.parameters())
    full = model_states(dataclasses.replace(CFG, lora=dataclasses.replace(QLORA, base_dtype="fp32")), sharding, dims,
                        rank_stages(CFG, sharding, 1)[0], 0)
    assert planned["params_bytes"] < full["params_bytes"]


def test_plan_counts_an_fsdp2_ranks_rows_of_each_nf4_weight():
    """Under FSDP2 a rank holds its rows' codes and scales of each 4-bit weight plus the whole tensor's scale mean
    and code table: the plan's bytes for the adapted weights, rank by rank, are those of torchao's chunk."""
    cfg = dataclasses.replace(CFG, lora=dataclasses.replace(QLORA, targets=["up"]))  # 128 -> 256: two blocks
    fp32 = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, base_dtype="fp32"))
    sharding = ShardingConfig(strategy="zero3", dp_shard=2)
    dims = ParallelDims.from_config(sharding)
    stage = rank_stages(cfg, sharding, 1)[0]
    whole = qlora.quantize(torch.randn(256, 128))
    for rank in range(2):
        rows = torch.chunk(whole, 2, dim=0)[rank]  # what fully_shard keeps on `rank` (torchao's split)
        saved = (model_states(fp32, sharding, dims, stage, rank)["params_bytes"]
                 - model_states(cfg, sharding, dims, stage, rank)["params_bytes"])
        assert saved == cfg.n_layers * (4 * rows.numel() - tensor_bytes(rows))


def test_plan_keeps_no_autocast_copy_of_an_nf4_weight():
    """bf16 autocast saves a bf16 copy of each matmul weight for backward; torchao's NF4 linear saves the 4-bit
    weight itself and dequantizes again in backward, so the plan's weight_casts leave the adapted weights out."""
    from trainctl.config.schema import PrecisionConfig, TrainConfig
    from trainctl.plan.memory import estimate

    sharding = ShardingConfig(strategy="ddp", dp_replicate=2)
    dims, train = ParallelDims.from_config(sharding), TrainConfig(seq_len=64, micro_batch=2, global_batch=4)
    bf16 = PrecisionConfig(compute_dtype="bf16")

    def casts(lora):
        m = dataclasses.replace(CFG, lora=lora)
        return estimate(m, bf16, sharding, train, dims, rank_stages(m, sharding, 1)[0]).weight_casts

    adapted = CFG.n_layers * 128 * (4 * 128 + 256)  # q, k, v, o 128 x 128 and up 128 -> 256 per layer
    assert casts(dataclasses.replace(QLORA, base_dtype="fp32")) - casts(QLORA) == 2 * adapted


def test_an_nf4_projection_under_autocast_saves_no_dense_weight():
    """What the plan's weight_casts assume, measured: the tensors autograd saves in an adapted NF4 projection's
    forward under bf16 autocast hold no dense copy of the [out, in] weight."""
    layer = LoRALinear(128, 256, False, rank=4, alpha=8.0, dropout=0.0)
    layer.reset_adapter()
    layer.weight.requires_grad_(False)
    layer.weight = torch.nn.Parameter(qlora.quantize(layer.weight), requires_grad=False)
    saved = []
    x = torch.randn(8, 128, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x).float().sum().backward()
    dense = [t for t in saved if not qlora.is_nf4(t) and tuple(t.shape) == (256, 128)]
    assert any(qlora.is_nf4(t) for t in saved) and dense == []


def _problems(overrides):
    with pytest.raises(ConfigError) as info:
        resolve(compose(["recipe=tiny_cpu", *overrides]))
    return info.value.problems


@pytest.mark.parametrize(("overrides", "words"), [
    (["model.lora.base_dtype=nf4"], ["model.lora.base_dtype=nf4", "model.lora.rank=0"]),
    (["model.lora.rank=8", "model.lora.base_dtype=nf4", "model.dim=64", "model.n_heads=4", "model.n_kv_heads=2"],
     ["model.lora.base_dtype=nf4", "16384", "q 64x64", "k 64x32"]),
    (["model.lora.rank=8", "model.lora.base_dtype=nf4", "sharding=fsdp", "cluster.procs_per_node=2",
      "sharding.cpu_offload=true", "model.dim=128", "model.n_kv_heads=4", "model.ffn_dim=256"],
     ["sharding.cpu_offload=true", "model.lora.base_dtype=nf4", "sharding.cpu_offload=false"]),
    # dim 128, 4 kv heads: q is 128 x 128, one scale-factor block, which 2 FSDP2 ranks cannot split
    (["model.lora.rank=8", "model.lora.base_dtype=nf4", "sharding=fsdp", "cluster.procs_per_node=2",
      "model.dim=128", "model.n_kv_heads=4", "model.ffn_dim=256", "model.lora.targets=[q,up]"],
     ["model.lora.base_dtype=nf4 with sharding.dp_shard=2", "q 128x128", "sharding=ddp"]),
    (["model.lora.rank=8", "model.lora.base_dtype=int4"], ["model.lora.base_dtype", "fp32, nf4"]),
])
def test_bad_nf4_configs_are_one_line_each(overrides, words):
    problems = _problems(overrides)
    line = next(p for p in problems if words[0] in p)
    assert all(w in line for w in words), line
    assert "\n" not in line


def test_nf4_composes_with_ddp_zero1_and_fsdp2():
    for sharding in ("ddp", "zero1"):
        cfg = resolve(compose(["recipe=tiny_cpu", "model.lora.rank=8", "model.lora.base_dtype=nf4",
                               f"sharding={sharding}", "cluster.procs_per_node=2"]))
        assert cfg.model.lora.base_dtype == "nf4"
    # gate, up and down 128 x 256: two scale-factor blocks each, one per rank (hsdp shards over dp_shard=2)
    layouts = ((["sharding=fsdp"], 2), (["sharding=zero2"], 2), (["sharding=hsdp", "sharding.dp_shard=2"], 4))
    for sharding, procs in layouts:
        cfg = resolve(compose(["recipe=tiny_cpu", "model.lora.rank=8", "model.lora.base_dtype=nf4", *sharding,
                               f"cluster.procs_per_node={procs}",
                               "train.micro_batch=4", "model.dim=128", "model.n_kv_heads=4", "model.ffn_dim=256",
                               "model.lora.targets=[gate,up,down]"]))
        assert cfg.model.lora.base_dtype == "nf4"


def write_manifest(ckpt: Path, step: int) -> None:
    rels = [rel for rel in list_files(ckpt) if rel != MANIFEST]
    files = {rel: {"size": (ckpt / rel).stat().st_size, "sha256": sha256(ckpt / rel)} for rel in rels}
    (ckpt / MANIFEST).write_text(json.dumps({"step": step, "world_size": 1, "files": files}))


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory):
    """A run directory whose committed checkpoint holds the NF4 base as the worker saves it (DCP, torchao's
    pickle), the adapters beside it; and the model itself."""
    root = tmp_path_factory.mktemp("qlora") / "run"
    model = _model()
    root.mkdir(parents=True)
    (root / "config.yaml").write_text(to_yaml(RunConfig(model=CFG)))
    ckpt = root / "checkpoints" / "step-00000003"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt), no_dist=True)
    (ckpt / "meta.json").write_text(json.dumps({"step": 3, "model": model_record.record(CFG)}))
    write_manifest(ckpt, 3)
    return root, model


def export(run_dir: Path, out: Path, flag: str, capsys) -> str:
    assert export_module.main(tool_argv(ExportOptions, [str(run_dir), "--out", str(out), flag])) == 0
    return capsys.readouterr().out


def test_merged_export_is_the_dequantized_base_plus_adapters_and_says_so(qlora_run, tmp_path, capsys):
    from safetensors.torch import load_file

    run_dir, model = qlora_run
    said = export(run_dir, tmp_path / "merged", "--merged", capsys)
    assert "dequantized" in said
    exported = {}
    for shard in (tmp_path / "merged").glob("*.safetensors"):
        exported.update(load_file(shard))
    plain = dequantized_merged_model(model)
    expected = dict(to_hf(n, t, plain.cfg) for n, t in plain.state_dict().items())
    assert exported.keys() == expected.keys()
    worst = max((exported[n] - expected[n]).abs().max() for n in expected)
    assert worst <= 8 * torch.finfo(torch.float32).eps  # merge sums in float64, rounds once to fp32


def test_adapter_loads_in_peft_on_the_full_precision_base(qlora_run, tmp_path, capsys):
    """peft reads every adapter key onto the unquantized base (none missing, none unexpected); on the dequantized
    base it computes the QLoRA forward."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    run_dir, model = qlora_run
    said = export(run_dir, tmp_path / "adapter", "--adapter", capsys)
    assert "4-bit NF4 base" in said
    export(run_dir, tmp_path / "merged", "--merged", capsys)  # for its config.json
    hf_cfg = transformers.AutoConfig.from_pretrained(tmp_path / "merged")

    def hf_model(state: dict) -> torch.nn.Module:
        hf = transformers.LlamaForCausalLM(hf_cfg).eval()
        hf.load_state_dict(dict(to_hf(n, t, CFG) for n, t in state.items() if ".lora_" not in n))
        return hf

    full_precision = hf_model(_model(quantize=False).state_dict())
    peft_config = peft.LoraConfig(**{k: v for k, v in json.loads((tmp_path / "adapter" / "adapter_config.json")
                                                                   .read_text()).items()
                                     if k in ("r", "lora_alpha", "lora_dropout", "target_modules", "bias")})
    wrapped = peft.get_peft_model(full_precision, peft_config)
    loaded = peft.set_peft_model_state_dict(wrapped, load_file(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert loaded.unexpected_keys == []
    assert [k for k in loaded.missing_keys if "lora_" in k] == []

    dequantized = hf_model({n: qlora.dequantized(t).detach() for n, t in model.state_dict().items()})
    tokens = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        peft_logits = peft.PeftModel.from_pretrained(dequantized, tmp_path / "adapter").eval()(tokens).logits
        ours = model(tokens)
    terms = forward_terms(CFG, 16) + CFG.lora.rank
    assert_close_fp(peft_logits, ours, torch.float32, terms, what="peft on the dequantized base against QLoRA")


def _restore_from(ckpt: Path, model: torch.nn.Module):
    def restore():
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
        model.load_state_dict(state["model"])
        return "restored"
    return restore


def test_a_resume_reads_the_nf4_base_bitwise_and_a_full_precision_source_is_quantized_after(qlora_run, tmp_path):
    """The worker's order around a checkpoint read (train/loop/qlora_start.py): a 4-bit run's checkpoint is read
    into NF4 tensors; a full-precision one is read first, then quantized; a 4-bit one under fp32 is refused."""
    from trainctl.train.errors import WorkerConfigError
    from trainctl.train.loop.qlora_start import around_restore

    run_dir, saved = qlora_run
    ckpt = run_dir / "checkpoints" / "step-00000003"
    live = build_model(CFG, "cpu")
    live.init_weights()  # another base than the saved one: the read must replace it
    assert around_restore(live, CFG, ckpt, _restore_from(ckpt, live)) == "restored"
    for name, tensor in saved.state_dict().items():
        got = live.state_dict()[name]
        assert qlora.is_nf4(got) == qlora.is_nf4(tensor), name
        assert torch.equal(qlora.dequantized(got), qlora.dequantized(tensor)), name

    full = _model(quantize=False)
    source = tmp_path / "full"
    dcp.save({"model": full.state_dict()}, checkpoint_id=str(source), no_dist=True)
    fresh = build_model(CFG, "cpu")
    fresh.init_weights()
    around_restore(fresh, CFG, source, _restore_from(source, fresh))
    wq = fresh.layers["0"].attention.wq.weight
    assert qlora.is_nf4(wq)
    expected = qlora.quantize(full.layers["0"].attention.wq.weight).get_original_weight()
    assert torch.equal(wq.get_original_weight(), expected)

    fp32 = dataclasses.replace(CFG, lora=dataclasses.replace(QLORA, base_dtype="fp32"))
    with pytest.raises(WorkerConfigError, match="model.lora.base_dtype=nf4"):
        around_restore(build_model(fp32, "cpu"), fp32, ckpt, lambda: None)
