"""The optimizer and schedule registries: optim.name dispatches (AdamW, Adafactor), the plan's state bytes equal
the live state tensors of a real step, the combinations an optimizer cannot run are refused at compose time in one
line, and schedule.name dispatches through core/schedules.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trainctl.config.compose import compose
from trainctl.config.errors import ConfigError
from trainctl.config.schema import (
    OPTIMIZERS,
    SCHEDULES,
    LoRAConfig,
    ModelConfig,
    OptimConfig,
    PrecisionConfig,
    RunConfig,
    ScheduleConfig,
    ShardingConfig,
    TrainConfig,
)
from trainctl.config.validate import resolve
from trainctl.core import optimizers, schedules
from trainctl.core.dims import ParallelDims
from trainctl.core.tensors import Tensor
from trainctl.models.build import build_model
from trainctl.plan import memory, rank_states
from trainctl.plan.runplan import build as build_plan
from trainctl.plan.stages import rank_stages
from trainctl.train.observe.memory_stats import model_state_bytes, tensor_bytes
from trainctl.train.optim import OPTIMIZER_BUILDERS, build_optimizer

SMALL = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=128, max_seq_len=64)


def stepped(model_cfg: ModelConfig, name: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = build_model(model_cfg, "cpu")
    if model_cfg.lora.rank == 0:
        model.init_weights()
    opt = build_optimizer(model, OptimConfig(name=name, lr=1e-3), "cpu")
    model(torch.randint(0, model_cfg.vocab_size, (2, 16))).float().square().mean().backward()
    opt.step()
    return model, opt


def planned_optimizer_bytes(model_cfg: ModelConfig, name: str) -> int:
    sharding = ShardingConfig()
    (stage,) = rank_stages(model_cfg, sharding, 1)
    return rank_states.model_states(model_cfg, sharding, ParallelDims(), stage, 0, optim=name)["optimizer_bytes"]


def test_the_registry_names_are_the_choices_and_every_one_has_a_builder():
    assert OPTIMIZERS == optimizers.names() == tuple(OPTIMIZER_BUILDERS) == (
        "adamw", "adafactor", "sgd", "lion", "adamw8bit", "adamw4bit", "adamwfp8", "muon")


# The low-bit AdamWs compile their step (torchao, Inductor): their live bytes after real steps are checked in
# test_optimizer_parity's slow test_low_bit_adamw_holds_the_planned_state_and_resumes_bitwise instead, and their
# formula below against torchao's own buffers.
@pytest.mark.parametrize("name", ["adamw", "adafactor", "sgd", "lion", "muon"])
@pytest.mark.parametrize("lora", [0, 4])
def test_plan_optimizer_bytes_equal_the_live_state_of_a_real_step(name, lora):
    model_cfg = dataclasses.replace(SMALL, lora=LoRAConfig(rank=lora, targets=["q", "v", "down"]))
    model, opt = stepped(model_cfg, name)
    measured = model_state_bytes(model, opt)["optimizer_bytes"]
    assert measured == planned_optimizer_bytes(model_cfg, name) > 0


def test_sgd_without_momentum_keeps_no_state_and_the_plan_counts_none():
    torch.manual_seed(0)
    model = build_model(SMALL, "cpu")
    plain = OptimConfig(name="sgd", lr=1e-2, momentum=0.0)
    opt = build_optimizer(model, plain, "cpu")
    model(torch.randint(0, SMALL.vocab_size, (2, 16))).float().square().mean().backward()
    opt.step()
    sharding = ShardingConfig()
    (stage,) = rank_stages(SMALL, sharding, 1)
    assert model_state_bytes(model, opt)["optimizer_bytes"] == 0
    assert rank_states.model_states(SMALL, sharding, ParallelDims(), stage, 0, optim=plain)["optimizer_bytes"] == 0


@pytest.mark.parametrize("name", ["adamw8bit", "adamw4bit", "adamwfp8"])
def test_low_bit_state_formula_is_torchaos_buffers(name):
    """torchao's zero-filled states (no compiled step needed) have the bytes core/optimizers.py counts."""
    torchao_optim = pytest.importorskip("torchao.optim")
    cls = {"adamw8bit": torchao_optim.AdamW8bit, "adamw4bit": torchao_optim.AdamW4bit,
           "adamwfp8": torchao_optim.AdamWFp8}[name]
    low = optimizers.LOW_BIT[name]
    # Quantized; under 4096 elements; a vector; 4224 elements: whole blocks of 128 (4-bit) but not of 256.
    for rows, cols in [(64, 64), (32, 64), (63, 64), (4096, 1), (96, 64), (66, 64)]:
        p = torch.nn.Parameter(torch.zeros(rows, cols))
        opt = cls([p])
        assert opt.block_size == low.block
        state = [opt._new_buffer(p, signed=True), opt._new_buffer(p, signed=False)]
        measured = sum(tensor_bytes(t) for t in state) + optimizers.STEP_BYTES
        assert measured == optimizers.spec(name).state_bytes(Tensor("layers.0.w", rows, cols), None)


def test_optim_name_dispatches_to_the_optimizer_it_names():
    _, adamw = stepped(SMALL, "adamw")
    model, adafactor = stepped(SMALL, "adafactor")
    assert type(adamw) is torch.optim.AdamW and type(adafactor) is torch.optim.Adafactor
    wq = model.layers["0"].attention.wq.weight
    state = adafactor.state[wq]
    # Factored: one value per row and per column, not one per element as AdamW's moments.
    assert state["row_var"].numel() + state["col_var"].numel() == wq.shape[0] + wq.shape[1]


@pytest.mark.parametrize(("name", "device_type", "pins"), [("adamw8bit", "cpu", True), ("adamw8bit", "cuda", True),
                                                          ("adamw", "cpu", False)])
def test_a_compiled_optimizer_step_on_cpu_pins_inductors_vector_width(monkeypatch, name, device_type, pins):
    """torchao's low-bit step is torch.compile'd: on CPU parameters (here on CPU even for a cuda run, as under CPU
    offload) Inductor's vector width joins its cache key first (train/inductor_isa.py), or a cache entry written on
    another code path is reused (NaN, or an abort). The eager optimizers compile nothing and pay nothing."""
    pytest.importorskip("torchao")
    import trainctl.train.optim as optim_module

    calls = []
    monkeypatch.setattr(optim_module, "pin_cpu_vector_isa", lambda: calls.append(1))
    build_optimizer(build_model(SMALL, "cpu"), OptimConfig(name=name, lr=1e-3), device_type)
    assert len(calls) == int(pins)


def test_adafactor_keeps_less_state_than_adamw_in_the_plan():
    tiny = ModelConfig()
    adamw, adafactor = planned_optimizer_bytes(tiny, "adamw"), planned_optimizer_bytes(tiny, "adafactor")
    assert adafactor < adamw / 10  # the embedding and output are matrices too: factored


def test_optim_adafactor_composes_from_its_yaml():
    cfg = resolve(compose(["optim=adafactor"]))
    assert (cfg.optim.name, cfg.optim.lr, cfg.optim.weight_decay) == ("adafactor", 1e-2, 0.0)


ADAFACTOR = OptimConfig(name="adafactor", lr=1e-2, weight_decay=0.0)


def run(sharding: ShardingConfig, procs: int, optim: OptimConfig = ADAFACTOR) -> RunConfig:
    """A RunConfig built directly (resolve takes a fraction of a millisecond; compose a few hundred)."""
    cluster = dataclasses.replace(RunConfig().cluster, procs_per_node=procs)
    return RunConfig(optim=optim, sharding=sharding, cluster=cluster)


DTENSOR_LAYOUTS = {
    "zero3": ShardingConfig(strategy="zero3", dp_shard=2),
    "zero2": ShardingConfig(strategy="zero2", dp_shard=2),
    "tp": ShardingConfig(strategy="none", tp=2),
    "ddp+pp": ShardingConfig(strategy="ddp", pp=2),  # FSDP2 as DDP
}


@pytest.mark.parametrize("layout", list(DTENSOR_LAYOUTS))
def test_adafactor_on_dtensor_parameters_is_refused_in_one_line(layout):
    with pytest.raises(ConfigError) as err:
        resolve(run(DTENSOR_LAYOUTS[layout], 2))
    (line,) = [p for p in err.value.problems if p.startswith("optim.name")]
    assert "DTensor" in line and "optim.name=adamw" in line


PLAIN_LAYOUTS = {
    "none": ShardingConfig(strategy="none"),
    "ddp": ShardingConfig(strategy="ddp", dp_replicate=2),
    "zero1": ShardingConfig(strategy="zero1", dp_replicate=2),
    "pp": ShardingConfig(strategy="none", pp=2, pp_schedule="gpipe"),
}


@pytest.mark.parametrize("layout", list(PLAIN_LAYOUTS))
def test_adafactor_on_plain_parameters_is_accepted(layout):
    procs = 1 if layout == "none" else 2
    assert resolve(run(PLAIN_LAYOUTS[layout], procs)).optim.name == "adafactor"


def test_a_key_the_optimizer_does_not_read_is_refused_not_ignored():
    with pytest.raises(ConfigError) as err:
        resolve(run(ShardingConfig(), 1, dataclasses.replace(ADAFACTOR, beta1=0.8)))
    assert err.value.problems == ["optim.beta1=0.8: optim.name=adafactor does not use it (it reads lr, weight_decay, "
                                  "beta2_decay); drop it, or choose an optimizer that does"]
    with pytest.raises(ConfigError) as err:
        resolve(run(ShardingConfig(), 1, OptimConfig(beta2_decay=-0.5)))
    assert any(p.startswith("optim.beta2_decay=-0.5: optim.name=adamw does not use it") for p in err.value.problems)


def test_plan_zero1_busiest_rank_counts_the_optimizers_own_bytes():
    """zero1 with Adafactor: the busiest rank is the one with the most state bytes, not the most elements."""
    tiny = ModelConfig()
    sharding, dims = ShardingConfig(strategy="zero1", dp_replicate=2), ParallelDims(dp_replicate=2)
    (stage,) = rank_stages(tiny, sharding, 1)
    per_rank = [rank_states.model_states(tiny, sharding, dims, stage, r, optim="adafactor")["optimizer_bytes"]
                for r in range(2)]
    est = memory.estimate(tiny, PrecisionConfig(), sharding, TrainConfig(), dims, stage, "cpu", "adafactor")
    assert est.optimizer == max(per_rank) and min(per_rank) > 0


def test_schedule_names_are_the_registry_and_lr_at_dispatches_through_it(monkeypatch):
    """A schedule added to core/schedules.py is a valid schedule.name and lr_at steps by its decay."""
    assert SCHEDULES == schedules.names() == ("constant", "linear", "cosine", "wsd")
    step_down = schedules.ScheduleSpec("halve", lambda progress: 0.5, schedules.SCHEDULES["linear"].decay_start, "")
    monkeypatch.setitem(schedules.SCHEDULES, "halve", step_down)
    halve = ScheduleConfig(name="halve", warmup_steps=2, min_lr_ratio=0.0)
    assert [schedules.lr_at(s, 1.0, halve, 10) for s in (1, 2, 3, 9)] == [1.0, 1.0, 0.5, 0.5]


def test_the_plan_names_a_non_default_optimizers_state_in_a_note():
    plain = ShardingConfig(strategy="ddp", dp_replicate=2)
    adafactor = build_plan(resolve(run(plain, 2)))
    assert any(n.startswith("optimizer ") and "(adafactor): Adafactor factored" in n for n in adafactor.notes)
    adamw = build_plan(resolve(run(plain, 2, OptimConfig())))
    assert not any(n.startswith("optimizer ") and "(adamw)" in n for n in adamw.notes)


@pytest.mark.parametrize(("key", "value"), [("lr", 0.0), ("lr", -1e-3), ("lr", float("nan")), ("beta1", 0.0),
                                            ("beta1", 1.0), ("beta2", 1.5), ("beta2", -0.1)])
def test_a_learning_rate_or_beta_out_of_range_is_one_line(key, value):
    with pytest.raises(ConfigError) as err:
        resolve(run(ShardingConfig(), 1, dataclasses.replace(OptimConfig(name="lion"), **{key: value})))
    (line,) = err.value.problems
    assert line.startswith(f"optim.{key}=")


@pytest.mark.parametrize(("name", "layout", "words"), [
    ("adamw8bit", ShardingConfig(strategy="zero1", dp_replicate=2), ("zero1", "sharding=ddp")),
    ("adamw4bit", ShardingConfig(strategy="zero3", dp_shard=2), ("DTensor", "ddp")),
    ("adamw8bit", ShardingConfig(strategy="zero3", dp_shard=2), ("DTensor", "ddp")),
    ("adamw8bit", ShardingConfig(strategy="none", tp=2), ("sharding.tp=2", "DTensor", "ddp")),
    ("muon", ShardingConfig(strategy="zero1", dp_replicate=2), ("zero1", "sharding=ddp")),
])
def test_an_optimizer_a_layout_cannot_hold_is_refused_naming_what_works(name, layout, words):
    with pytest.raises(ConfigError) as err:
        resolve(run(layout, 2, OptimConfig(name=name)))
    (line,) = err.value.problems
    assert line.startswith(f"optim.name={name}:") and all(w in line for w in words), line


@pytest.mark.parametrize("name", ["sgd", "lion", "muon"])
@pytest.mark.parametrize("layout", list(DTENSOR_LAYOUTS) + ["zero1"])
def test_elementwise_optimizers_and_muon_run_on_every_layout(name, layout):
    """Muon on DTensor parameters gathers each matrix for Newton-Schulz (train/muon.py); zero1 refuses it (above)."""
    if (name, layout) == ("muon", "zero1"):
        return
    sharding = DTENSOR_LAYOUTS.get(layout) or PLAIN_LAYOUTS[layout]
    cfg = dataclasses.replace(run(sharding, 2, OptimConfig(name=name)), train=TrainConfig(grad_accum=2))  # pp's
    assert resolve(cfg).optim.name == name


def test_muon_with_every_matrix_excluded_and_low_bit_with_nothing_to_quantize_are_refused():
    rank1 = dataclasses.replace(ModelConfig(), lora=LoRAConfig(rank=1))
    with pytest.raises(ConfigError) as err:
        resolve(dataclasses.replace(run(ShardingConfig(), 1, OptimConfig(name="muon")), model=rank1))
    (line,) = err.value.problems
    assert line.startswith("optim.name=muon: no trainable hidden matrix")
    assert resolve(dataclasses.replace(run(ShardingConfig(), 1, OptimConfig(name="muon")),
                                       model=dataclasses.replace(rank1, lora=LoRAConfig(rank=2)))).optim.name == "muon"
    ends = [Tensor("tok_embeddings.weight", 256, 64), Tensor("output.weight", 256, 64), Tensor("norm.weight", 64, 1)]
    assert optimizers.model_problems("muon", ends) and not optimizers.model_problems("adamw", ends)
    assert optimizers.model_problems("adamw8bit", ends[2:]) and not optimizers.model_problems("adamw8bit", ends)


def test_muon_leaves_stacked_experts_to_adamw_and_the_plan_counts_them_so():
    """GroupedExperts' [E, a, b] weights are not 2-D matrices (torch.optim.Muon takes those only): AdamW's two
    moments and step, in the worker and in the plan alike; the router [E, dim] is a hidden matrix, Muon's."""
    moe = compose(["model=qwen3_moe_tiny"]).model
    model, opt = stepped(moe, "muon")
    experts = model.layers["0"].feed_forward.experts
    assert set(opt.state[experts.w1]) == {"exp_avg", "exp_avg_sq", "step"}
    assert set(opt.state[model.layers["0"].feed_forward.router.weight]) == {"momentum_buffer"}
    assert model_state_bytes(model, opt)["optimizer_bytes"] == planned_optimizer_bytes(moe, "muon")
    assert not optimizers.muon_steps(Tensor("layers.0.feed_forward.experts.w2", 4, 64 * 64))
    assert not optimizers.muon_steps(Tensor("experts", 2, 64 * 64))  # plan/experts.py's share under ep


def test_muon_step_temporaries_are_the_whole_largest_matrix_gathered_when_sharded():
    """Newton-Schulz runs on the whole largest matrix (n elements, smaller side m) in every layout: its fp32 update
    and bf16 iterates (8n + 4m^2 bytes). Sharded (zero3, tp), the shard's update and the all-gather's output come
    first (4n/2 + 4n), plus DTensor's copy into the whole layout for tp's row-wise (dim 1) shards (+4n, here the
    larger)."""
    model_cfg = dataclasses.replace(SMALL, ffn_dim=256)
    n, m = 256 * 64, 64
    newton_schulz, dim0_gather = 4 * n + 2 * (2 * n + 2 * m * m), 4 * (n // 2 + n)
    row_wise_gather = dim0_gather + 4 * n
    for sharding, dims, want in [
            (ShardingConfig(), ParallelDims(), newton_schulz),
            (ShardingConfig(strategy="zero3", dp_shard=2), ParallelDims(dp_shard=2), newton_schulz),
            (ShardingConfig(strategy="none", tp=2), ParallelDims(tp=2), row_wise_gather)]:
        (stage,) = rank_stages(model_cfg, sharding, 1)
        mem = memory.estimate(model_cfg, PrecisionConfig(), sharding, TrainConfig(), dims, stage, "cuda",
                              OptimConfig(name="muon"))
        assert mem.step_temp == want, sharding
    assert row_wise_gather > newton_schulz > dim0_gather


def test_muon_under_fsdp_and_tp_gathers_tp_first_and_holds_fsdps_chunk_not_a_whole_copy():
    """fsdp + tp (dp_shard=2, tp=2): DTensor.full_tensor gathers the tp mesh dim first, so beside the whole update it
    holds FSDP2's chunk of it ([rows / 2, cols]: a row-wise shard's copy into its layout, or a col-wise shard's tp
    gather, strided within FSDP2's chunk), not a whole copy as tp alone makes. With a wide row-wise matrix (w2: 64 x
    512, more than 4 m^2 elements) a whole copy would have outgrown Newton-Schulz's 8n + 4m^2; FSDP2's chunk cannot
    (n/4 + n + n/2 < 8n): the step's temporaries are Newton-Schulz's, where tp alone keeps the gather's."""
    model_cfg = dataclasses.replace(SMALL, ffn_dim=512)
    n, m = 64 * 512, 64
    newton_schulz = 4 * n + 2 * (2 * n + 2 * m * m)
    fsdp_tp = ShardingConfig(strategy="fsdp", dp_shard=2, tp=2)
    tp_only = ShardingConfig(strategy="none", tp=2)
    got = {}
    for sharding, dims in [(fsdp_tp, ParallelDims(dp_shard=2, tp=2)), (tp_only, ParallelDims(tp=2))]:
        (stage,) = rank_stages(model_cfg, sharding, 1)
        got[sharding.strategy] = memory.estimate(model_cfg, PrecisionConfig(), sharding, TrainConfig(), dims, stage,
                                                 "cuda", OptimConfig(name="muon")).step_temp
    gathered_with_chunk, gathered_with_copy = 4 * (n // 4 + n + n // 2), 4 * (n // 4 + n + n)
    assert got["fsdp"] == newton_schulz > gathered_with_chunk and gathered_with_copy > newton_schulz
    assert got["none"] == 4 * (n // 2 + n + n) > newton_schulz  # tp alone: the shard, the gather, the copy


def test_foreach_adamw_temporaries_are_its_largest_param_groups():
    """torch's foreach AdamW steps one param group at a time, each allocating one fp32 denominator per element: the
    decayed matrices' group or the rest (embedding, norms), the larger; fused AdamW (CUDA) allocates none."""
    ts = [Tensor("tok_embeddings.weight", 256, 64), Tensor("layers.0.attention.wq.weight", 64, 64),
          Tensor("output.weight", 256, 64), Tensor("norm.weight", 64, 1)]
    assert optimizers.step_temp_bytes("adamw", ts, ts, False) == 4 * (64 * 64 + 256 * 64)
    assert optimizers.step_temp_bytes("adamw", ts[:1] + ts[3:], ts, False) == 4 * (256 * 64 + 64)
    assert optimizers.step_temp_bytes("adamw", ts, ts, True) == 0
