"""Composition, typing and validation of configs: every recipe and every group option.

The parallel layout and the batch math: test_config_layout.py.
"""

from __future__ import annotations

import dataclasses

import pytest

from trainctl.config import load, schema
from trainctl.config.compose import compose, list_options, recipe_description
from trainctl.config.errors import ConfigError
from trainctl.config.validate import resolve

RECIPES = list_options("recipe")

# A group option composed onto llama7b_fsdp (Slurm, 8 GPUs, FSDP) sometimes needs a
# companion change to be a valid run; each one says why.
FIXUPS = {
    ("model", "tiny"): ["train.seq_len=256", "data=stdlib"],  # tiny's max_seq_len is 1024, vocab 256
    ("sharding", "none"): ["cluster.procs_per_node=1"],  # no data parallelism: one process
    ("data", "stdlib"): ["model=tiny", "train.seq_len=256"],  # byte corpus: vocab 256 fits any model; keep it small
    ("data", "hf"): ["data.source=org/corpus", "data.val_split=validation", "data.tokenizer=bytes"],
    ("optim", "adafactor"): ["sharding=ddp"],  # Adafactor cannot step FSDP2's DTensor shards
    # Neither can the low-bit AdamWs (torchao's quantized states on whole tensors only)
    **{("optim", name): ["sharding=ddp"] for name in ("adamw8bit", "adamw4bit", "adamwfp8")},
}


def test_recipes_exist():
    for required in ("tiny_cpu", "llama7b_fsdp", "llama3_8b_fp8", "llama70b_3d", "llama1b_bench"):
        assert required in RECIPES


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_composes_and_validates(recipe):
    cfg = resolve(compose([f"recipe={recipe}"]))
    assert cfg.recipe == recipe
    assert recipe_description(recipe)
    dims = (cfg.sharding.dp_replicate, cfg.sharding.dp_shard, cfg.sharding.cp, cfg.sharding.tp, cfg.sharding.pp)
    product = 1
    for d in dims:
        assert d >= 1
        product *= d
    assert product == cfg.cluster.nodes * cfg.cluster.procs_per_node
    t = cfg.train
    assert t.global_batch == t.micro_batch * t.grad_accum * cfg.sharding.dp_replicate * cfg.sharding.dp_shard


# model=hf needs a Hugging Face folder (model.path): tests/unit/test_hf_config.py composes it with one.
GROUP_OPTIONS = [(g, o) for g in schema.GROUPS for o in list_options(g) if (g, o) != ("model", "hf")]


@pytest.mark.parametrize(("group", "option"), GROUP_OPTIONS, ids=[f"{g}={o}" for g, o in GROUP_OPTIONS])
def test_every_group_option_composes_and_validates(group, option):
    overrides = ["recipe=llama7b_fsdp", f"{group}={option}", *FIXUPS.get((group, option), [])]
    composed = compose(overrides)
    resolve(composed)
    assert schema.option_of(group, getattr(composed, group)) == option


def test_recipe_choices_lose_to_command_line():
    cfg = compose(["recipe=llama7b_fsdp", "model=llama3_8b", "optim.lr=1e-4", "cluster.nodes=4"])
    assert cfg.model.name == "llama3_8b"
    assert cfg.optim.lr == 1e-4
    assert cfg.cluster.nodes == 4
    assert schema.option_of("precision", cfg.precision) == "bf16"  # still the recipe's


def test_defaults_without_recipe():
    cfg = compose([])
    options = tuple(
        schema.option_of(group, getattr(cfg, group)) for group in ("model", "precision", "sharding", "cluster")
    )
    assert options == ("tiny", "fp32", "none", "local")


def test_group_yaml_sets_published_shape():
    cfg = compose(["model=llama2_70b"])
    assert (cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads, cfg.model.n_kv_heads, cfg.model.ffn_dim) == (
        8192,
        80,
        64,
        8,
        28672,
    )


def _problems(overrides):
    with pytest.raises(ConfigError) as info:
        resolve(compose(overrides))
    return info.value.problems


def test_unknown_key_names_full_path_and_valid_keys():
    (line,) = _problems(["model.dimm=3"])
    assert line.startswith("model.dimm: unknown key")
    assert "n_kv_heads" in line


def test_unknown_nested_key_added_with_plus():
    (line,) = _problems(["+logging.wandb.projekt=x"])
    assert line.startswith("logging.wandb.projekt: unknown key")


def test_wrong_type_names_key():
    (line,) = _problems(["train.steps=many"])
    assert line.startswith("train.steps:") and "many" in line


def test_unknown_option_lists_valid_ones():
    (line,) = _problems(["model=llama4"])
    assert line.startswith("model=llama4: unknown model")
    for option in list_options("model"):
        assert option in line


def test_unknown_recipe_lists_recipes():
    (line,) = _problems(["recipe=gpt5"])
    assert "tiny_cpu" in line and "llama7b_fsdp" in line


def test_bad_override_syntax_is_one_line():
    (line,) = _problems(["train.steps"])
    assert "train.steps" in line and "\n" not in line


def test_list_override_and_group_deletion():
    cfg = compose(["recipe=tiny_cpu", "logging.wandb.tags=[a,b]", "~recipe"])
    assert cfg.logging.wandb.tags == ["a", "b"]
    assert cfg.recipe == ""  # ~recipe removed the recipe from the defaults list


def test_deleting_a_typed_key_is_a_clear_error():
    (line,) = _problems(["~model.dim"])
    assert line.startswith("model.dim")


def test_all_problems_reported_at_once():
    problems = _problems(
        [
            "recipe=tiny_cpu",
            "optim.lr=-1",
            "train.steps=0",
            "model.n_kv_heads=3",
            "train.seq_len=4096",
            "cluster.procs_per_node=3",
            "data.val_fraction=0",
        ]
    )
    keys = {p.split("=")[0].split(":")[0] for p in problems}
    assert {
        "optim.lr",
        "train.steps",
        "model.n_kv_heads",
        "train.seq_len",
        "train.global_batch",
        "data.val_fraction",
    } <= keys
    assert all("\n" not in p for p in problems)


def test_warmup_longer_than_training():
    (line,) = _problems(["train.steps=10", "schedule.warmup_steps=10"])
    assert line.startswith("schedule.warmup_steps=10") and "train.steps=10" in line


def test_heads_must_divide_dim():
    problems = _problems(["model.n_heads=7"])
    assert any(p.startswith("model.n_heads=7") for p in problems)


def test_unknown_choice_value():
    (line,) = _problems(["precision.compute_dtype=fp64"])
    assert "fp32" in line and "bf16" in line


def test_tp_must_divide_heads():
    problems = _problems(["recipe=llama7b_fsdp", "sharding.tp=3", "cluster.procs_per_node=6"])
    assert any(p.startswith("sharding.tp=3") for p in problems)


def test_memmap_needs_paths():
    problems = _problems(["data=memmap", "model=llama2_7b"])
    assert {p.split(":")[0] for p in problems} >= {"data.train_path", "data.val_path"}


def test_local_launch_cannot_span_nodes():
    problems = _problems(["cluster.nodes=2"])
    assert any(p.startswith("cluster.nodes=2") and "cluster=slurm" in p for p in problems)


def test_fp8_needs_fp8_gpu():
    problems = _problems(["recipe=llama3_8b_fp8", "cluster.gpu=a100"])
    assert any("fp8" in p and "a100" in p for p in problems)


def test_config_yaml_round_trips():
    cfg = resolve(compose(["recipe=llama70b_3d", "logging.wandb.tags=[x]"]))
    assert load.from_dict(__import__("omegaconf").OmegaConf.create(load.to_yaml(cfg))) == cfg


def test_run_name_must_be_one_folder():
    problems = _problems(["name=my run"])
    assert any(p.startswith("name='my run'") for p in problems)
    assert _problems(["name=a/b"])


def test_cpu_offload_needs_fsdp():
    problems = _problems(["recipe=tiny_cpu", "sharding.cpu_offload=true"])
    assert any(p.startswith("sharding.cpu_offload") and "zero3" in p for p in problems)


# Published parameter counts (model cards / papers); the plan's count must match each one.
PUBLISHED_PARAMS = {
    "llama2_7b": 6_738_415_616,
    "llama2_13b": 13_015_864_320,
    "llama2_70b": 68_976_648_192,
    "llama3_8b": 8_030_261_248,
    "llama3_70b": 70_553_706_496,
    "llama3_1b": 1_235_814_400,  # Llama 3.2 1B, tied embeddings
    # model cards' safetensors totals; tests/dist/test_families.py rebuilds most of them with transformers on meta
    "llama3_2_1b": 1_235_814_400,
    "llama3_2_3b": 3_212_749_824,
    "llama3_1_8b": 8_030_261_248,
    "llama3_1_70b": 70_553_706_496,
    "qwen2_5_0_5b": 494_032_768,
    "qwen2_5_7b": 7_615_616_512,
    "qwen3_0_6b": 596_049_920,
    "qwen3_8b": 8_190_735_360,
    "mistral_7b": 7_248_023_552,
    "qwen3_30b_a3b": 30_532_122_624,  # every expert counted (3,353,032,704 active per token)
    "mixtral_8x7b": 46_702_792_704,
}


@pytest.mark.parametrize(("model", "published"), PUBLISHED_PARAMS.items())
def test_plan_param_count_matches_published(model, published):
    from trainctl.plan.flops import param_count

    assert param_count(compose([f"model={model}"]).model) == published


def test_every_model_but_tiny_has_a_published_count():
    assert set(list_options("model")) - {"tiny", "qwen3_moe_tiny", "mixtral_tiny", "hf"} == set(PUBLISHED_PARAMS)


# ---------------------------------------------------------------- the cached schema template


def test_a_changed_schema_node_does_not_reach_the_next_caller():
    """structured_schema() hands out copies of one cached template: what a caller merges or sets stays its own."""
    first = load.structured_schema()
    first.train.steps = 987654
    first.cluster.env["LEAKED"] = "yes"  # a user-named map: open to new keys
    second = load.structured_schema()
    assert second.train.steps != 987654
    assert "LEAKED" not in second.cluster.env
    with pytest.raises(Exception, match="nosuchkey"):  # the copy keeps struct mode: unknown keys still fail
        second.train.nosuchkey = 1


def test_a_typed_merge_reads_the_template_without_changing_it():
    """from_dict merges onto the cached template itself (OmegaConf.merge copies it first): the merged values and a
    user-named map's new key stay in the merged node, never in the template the next caller reads."""
    merged, _ = load.typed_merge({"train": {"steps": 987654}, "cluster": {"env": {"LEAKED": "yes"}}})
    assert merged.train.steps == 987654 and merged.cluster.env["LEAKED"] == "yes"
    again, defaults = load.typed_merge({})
    assert again.train.steps != 987654 and "LEAKED" not in again.cluster.env and "LEAKED" not in defaults["env"]
    assert load.from_dict({"train": {"steps": 5}}).train.steps == 5
    assert load.structured_schema().train.steps == again.train.steps


def test_one_compose_does_not_leak_into_the_next():
    default_steps = compose([]).train.steps
    changed = compose(["cluster=slurm", f"train.steps={default_steps + 7}", "cluster.env.LEAKED=1"])
    assert changed.train.steps == default_steps + 7 and changed.cluster.env["LEAKED"] == "1"
    assert compose([]).train.steps == default_steps
    assert "LEAKED" not in compose(["cluster=slurm"]).cluster.env


def test_a_backend_registered_later_gets_its_keys_in_the_schema():
    """The template is keyed by the registered backends: one added after the first compose is not missed."""

    @dataclasses.dataclass(frozen=True)
    class LaterCluster(schema.ClusterConfig):
        NAME = "later_test_backend"
        later_only_key: int = 3

    load.structured_schema()
    schema.register_cluster(LaterCluster)
    try:
        assert load.structured_schema().cluster.later_only_key == 3
    finally:
        schema.unregister_cluster(LaterCluster.NAME)
    assert "later_only_key" not in load.structured_schema().cluster


def test_a_recipe_rewritten_in_the_same_tick_at_the_same_size_composes_afresh(tmp_path):
    """Composition is cached by the content of the files it may load, never by their timestamps."""
    import os

    from trainctl.config.sources import SearchPath

    (tmp_path / "recipes").mkdir()
    recipe = tmp_path / "recipes" / "mine.yaml"
    sp = SearchPath(user_dirs=(tmp_path,))
    recipe.write_text("# @package _global_\ndefaults:\n  - tiny_cpu\ntrain:\n  steps: 111\n")
    stamp = recipe.stat()
    assert compose(["recipe=mine"], sp).train.steps == 111
    recipe.write_text("# @package _global_\ndefaults:\n  - tiny_cpu\ntrain:\n  steps: 222\n")
    os.utime(recipe, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))  # as if written within one timestamp tick
    assert recipe.stat().st_size == stamp.st_size and recipe.stat().st_mtime_ns == stamp.st_mtime_ns
    assert compose(["recipe=mine"], sp).train.steps == 222
    assert compose([f"recipe={recipe}"]).train.steps == 222  # the same file named by path


def test_a_cached_composition_is_a_copy_and_failures_are_not_cached():
    first = compose(["recipe=tiny_cpu", "logging.wandb.tags=[a,b]"])
    first.logging.wandb.tags.append("leaked")  # a list inside the frozen config is the caller's own
    assert compose(["recipe=tiny_cpu", "logging.wandb.tags=[a,b]"]).logging.wandb.tags == ["a", "b"]
    for _ in range(2):  # the second call fails the same way: nothing of the first was kept
        with pytest.raises(ConfigError, match="train.steps"):
            compose(["recipe=tiny_cpu", "train.steps=abc"])
    assert load.from_dict({"train": {"steps": 5}}).train.steps == 5
    assert load.from_dict({"train": {"steps": 6}}).train.steps == 6  # another mapping, another entry
