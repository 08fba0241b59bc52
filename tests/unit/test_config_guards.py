"""Hostile config input: non-finite floats, world sizes below one, any number anywhere, literal `${`, paths as options.

Each bad value is one ConfigError line naming the key (never a traceback), and a config that
validation accepts can be planned and saved and read back unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random

import pytest

from trainctl.config import load, schema
from trainctl.config.compose import compose, list_options
from trainctl.config.errors import ConfigError
from trainctl.config.slurm import SlurmClusterConfig
from trainctl.config.validate import resolve
from trainctl.plan.runplan import build

RECIPES = list_options("recipe")


def keys_of_type(type_name: str, node=schema.RunConfig(), prefix: str = "") -> list[str]:
    """Dotted keys of every schema field annotated `type_name`, found by walking the dataclasses."""
    keys = []
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            keys += keys_of_type(type_name, value, key + ".")
        elif f.type == type_name:
            keys.append(key)
    return keys


FLOAT_KEYS = keys_of_type("float")
INT_KEYS = keys_of_type("int")


def replace_key(cfg, key: str, value):
    """`cfg` with the dotted `key` set to `value` (frozen dataclasses, rebuilt along the path)."""
    head, _, rest = key.partition(".")
    if not rest:
        return dataclasses.replace(cfg, **{head: value})
    return dataclasses.replace(cfg, **{head: replace_key(getattr(cfg, head), rest, value)})


def problems_of(cfg) -> list[str]:
    with pytest.raises(ConfigError) as err:
        resolve(cfg)
    return err.value.problems


def test_the_walk_finds_the_float_keys():
    expected = {"optim.lr", "optim.eps", "model.rope_theta", "cluster.assumed_mfu", "guards.spike_zscore"}
    assert expected <= set(FLOAT_KEYS)
    assert len(FLOAT_KEYS) >= 14


@functools.cache
def composed(*overrides: str) -> schema.RunConfig:
    return compose(list(overrides))


@pytest.mark.parametrize("key", FLOAT_KEYS)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_every_float_key_refuses_non_finite_values_in_one_line(key, value):
    problems = problems_of(replace_key(composed(), key, value))
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{key}=") and "not a finite number" in problems[0]


@pytest.mark.parametrize(
    "override", ["optim.lr=inf", "optim.lr=-inf", "optim.lr=nan", "model.norm_eps=inf", "guards.spike_zscore=nan"]
)
def test_non_finite_values_from_the_command_line(override):
    assert problems_of(compose([override])) == [f"{override}: not a finite number; use a finite value"]


@pytest.mark.parametrize("spelling", [".inf", "-.inf", ".nan", ".NaN", "1e999"])
def test_yaml_spellings_of_infinity_in_a_saved_config_are_refused(tmp_path, spelling):
    (tmp_path / "config.yaml").write_text(f"optim:\n  lr: {spelling}\n")
    (line,) = problems_of(load.load_run_config(tmp_path))
    assert line.startswith("optim.lr=") and "not a finite number" in line


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize(("key", "value"), [("nodes", 0), ("procs_per_node", 0), ("nodes", -1), ("procs_per_node", -3)])
def test_world_sizes_below_one_are_one_line_each(recipe, key, value):
    problems = problems_of(replace_key(composed(f"recipe={recipe}"), f"cluster.{key}", value))
    world = [p for p in problems if "cluster.nodes" in p or "cluster.procs_per_node" in p]
    assert world == [f"cluster.{key}={value}: must be >= 1"]
    assert not any("world size" in p for p in problems)  # nothing else reasons about a world of 0


BASES = ["", "recipe=tiny_3d_cpu", "recipe=llama70b_3d"]
INT_VALUES = [0, -1, -2, 3, 4096]
FLOAT_VALUES = [0.0, -1.0, 1e-300, 1e300]


@pytest.mark.parametrize("base", BASES)
def test_any_number_in_any_key_is_validated_or_planned_never_raised(base):
    """Every int and float key set to awkward values: a ConfigError or a plan, nothing else."""
    cfg = composed(*([base] if base else []))
    cases = [(k, v) for k in INT_KEYS for v in INT_VALUES] + [(k, v) for k in FLOAT_KEYS for v in FLOAT_VALUES]
    crashes = []
    for key, value in cases:
        try:
            build(resolve(replace_key(cfg, key, value)), with_advice=False)
        except ConfigError:
            pass
        except Exception as exc:  # noqa: BLE001 (the point: collect every crash, report them together)
            crashes.append(f"{key}={value}: {type(exc).__name__}: {exc}")
    assert not crashes, "\n".join(crashes)


# ---------------------------------------------------------------- literal ${ survives the saved config

NASTY = ["${", "\\${", "\\\\${", "${x}", "\\${x}", "$", "\\", "\\\\", "$${a}", "'", '"', "ü", "日本",
         "{", "}", ":", "#", " ", "a", "\n"]


def nasty_strings(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    fixed = ["a${b}", "${oc.env:HOME}", "x\\${y}", "\\\\\\${z}", "tail\\", "${", "\\", "'${x}'", '"${x}"']
    return fixed + ["".join(rng.choice(NASTY) for _ in range(rng.randint(1, 8))) for _ in range(n)]


def save_and_load(cfg, tmp_path):
    (tmp_path / "config.yaml").write_text(load.to_yaml(cfg))
    return load.load_run_config(tmp_path)


def test_every_string_round_trips_through_config_yaml(tmp_path):
    """Property-style: 300 random strings of the nastiest pieces, in every kind of string field (lists, maps too)."""
    texts = nasty_strings(300)
    for i in range(0, len(texts), 50):  # 50 strings per saved config: a round trip costs ~80 ms
        chunk = texts[i : i + 50]
        cfg = replace_key(schema.RunConfig(cluster=SlurmClusterConfig()), "description", chunk[0])  # has setup, env
        cfg = replace_key(cfg, "data.train_path", chunk[-1])
        cfg = replace_key(cfg, "logging.wandb.tags", chunk)
        cfg = replace_key(cfg, "cluster.setup", chunk[::-1])
        cfg = replace_key(cfg, "cluster.env", {f"X{j}": text for j, text in enumerate(chunk)})
        back = save_and_load(cfg, tmp_path)
        assert [a for a, b in zip(back.logging.wandb.tags, chunk, strict=True) if a != b] == []
        assert back == cfg


@pytest.mark.parametrize(
    ("override", "key", "expected"),
    [
        ("name=a\\${b}", "name", "a${b}"),
        ("description=x\\${y}z", "description", "x${y}z"),
        ("logging.wandb.tags=[a\\${x}]", "logging.wandb.tags", ["a${x}"]),
        ("data.train_path=/p/\\${x}.bin", "data.train_path", "/p/${x}.bin"),
    ],
)
def test_a_literal_interpolation_from_the_command_line_is_kept_and_saved_as_such(tmp_path, override, key, expected):
    cfg = compose([override])
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    assert value == expected
    assert save_and_load(cfg, tmp_path) == cfg


def test_a_live_interpolation_is_resolved_at_compose_time_and_saved_resolved(tmp_path):
    cfg = compose(["model=llama2_7b", "description=${model.name}"])
    assert cfg.description == "llama2_7b"
    assert save_and_load(cfg, tmp_path).description == "llama2_7b"


def test_an_unresolvable_interpolation_says_how_to_write_a_literal_one():
    with pytest.raises(ConfigError) as err:
        compose(["name=a${b}"])
    (line,) = err.value.problems
    assert line.startswith("name:") and "\\${" in line


# ---------------------------------------------------------------- options only from the config directories


@pytest.fixture
def outside_yaml(tmp_path):
    """A YAML file outside the config directories that a path-like option could reach."""
    evil = tmp_path / "evil.yaml"
    evil.write_text("# @package _global_\noptim:\n  lr: 0.123\n")
    return evil


def relative_to_group(path, group: str) -> str:
    """`path` (without .yaml) as Hydra would resolve it from the group's folder."""
    from trainctl.config.compose import conf_dir

    up = "../" * len((conf_dir() / group).resolve().parts[1:])
    return f"{up}{str(path.with_suffix('')).lstrip('/')}"


@pytest.mark.parametrize(
    "template",
    ["+recipe@_global_={rel_recipe}", "recipe={rel_recipe}", "+model@_global_={rel_model}", "model={rel_model}",
     "model={abs}", "+recipe@_global_={abs}", "data=[stdlib,{rel_data}]", "recipe='{rel_recipe}'"],
)
def test_options_that_are_paths_are_refused_before_loading(outside_yaml, template):
    override = template.format(
        rel_recipe=relative_to_group(outside_yaml, "recipe"), abs=str(outside_yaml.with_suffix("")),
        rel_model=relative_to_group(outside_yaml, "model"), rel_data=relative_to_group(outside_yaml, "data"))
    with pytest.raises(ConfigError) as err:
        compose([override])
    (line,) = err.value.problems
    if override.startswith("recipe="):  # a recipe may be a file, but only one named as such
        assert "a recipe file must end in .yaml" in line
        return
    assert line.startswith(override) and "not a" in line and "--config-dir" in line and "choose one of" in line


def test_a_recipe_file_named_by_path_loads_and_only_as_recipe(outside_yaml):
    assert compose([f"recipe={outside_yaml}"]).optim.lr == 0.123
    for override in (f"+recipe@_global_={outside_yaml}", f"model={outside_yaml}"):
        with pytest.raises(ConfigError):
            compose([override])
    with pytest.raises(ConfigError) as err:
        compose([f"recipe={outside_yaml.parent / 'missing.yaml'}"])
    assert "no such file" in err.value.problems[0]


@pytest.mark.parametrize("override", ["hydra.searchpath=[file:///tmp]", "++hydra.searchpath=[pkg://x]",
                                      "hydra/launcher=basic", "+hydra.job.chdir=true"])
def test_hydra_settings_are_refused(override):
    with pytest.raises(ConfigError) as err:
        compose([override])
    (line,) = err.value.problems
    assert line.startswith(override.split("=")[0]) and "--config-dir" in line


@pytest.mark.parametrize(
    "override", ["model=null", "recipe=null", "model=choice(tiny,llama2_7b)", "recipe/x=tiny_cpu", "model="]
)
def test_group_overrides_that_are_not_one_name_are_one_line(override):
    with pytest.raises(ConfigError) as err:
        compose([override])
    assert len(err.value.problems) == 1


@pytest.mark.parametrize(
    ("overrides", "lr"),
    [(["recipe=tiny_cpu"], 3e-3), (["+recipe@_global_=tiny_cpu"], 3e-3), (["recipe=tiny_cpu", "~recipe"], 3e-4),
     (["model=[tiny]"], 3e-4)],
)
def test_plain_names_still_compose(overrides, lr):
    assert compose(overrides).optim.lr == lr


# ---------------------------------------------------------------- one key names a group's option


RETIRED = sorted((group, key) for group, keys in load.RETIRED_KEYS.items() for key in keys)


@pytest.mark.parametrize(("group", "key"), RETIRED)
def test_a_retired_key_is_unknown_on_the_command_line(group, key):
    with pytest.raises(ConfigError) as err:
        compose([f"{group}.{key}=1"])
    (line,) = err.value.problems
    assert line.startswith(f"{group}.{key}: unknown key; valid keys of {group}: ")


def test_a_config_yaml_of_an_older_run_still_loads(tmp_path):
    """Runs written before the duplicate `name` keys were dropped must still resume and export."""
    cfg = compose(["recipe=llama7b_fsdp", "precision=fp8"])
    text = load.to_yaml(cfg)
    for group, option in (("precision", "fp8"), ("sharding", "fsdp"), ("cluster", "slurm"), ("data", "memmap")):
        text = text.replace(f"\n{group}:\n", f"\n{group}:\n  name: {option}\n", 1)
    (tmp_path / "config.yaml").write_text(text)
    text = text.replace("\nguards:\n", "\nguards:\n  inject_nan_step: -1\n", 1)
    assert text.count("  name: ") >= 5  # the model's own name, and the four retired ones
    assert "  inject_nan_step: -1" in text
    assert load.load_run_config(tmp_path) == cfg


@pytest.mark.parametrize(("override", "hint"), [
    ("train.max_restarts=2", "cluster.max_restarts"), ("optim.warmup_steps=3", "schedule.warmup_steps"),
    ("train.lr=1e-3", "optim.lr"),
])
def test_a_key_put_in_the_wrong_section_names_the_one_where_it_lives(override, hint):
    with pytest.raises(ConfigError) as err:
        compose([override])
    key = override.split("=")[0]
    (line,) = err.value.problems
    assert line.startswith(f"{key}: unknown key; did you mean {hint}? valid keys of {key.split('.')[0]}: ")


def test_no_guess_when_the_name_is_nowhere_or_in_several_sections():
    for override in ("model.nope=1", "precision.name=x"):  # precision.name: the run's `name` and model.name
        with pytest.raises(ConfigError) as err:
            compose([override])
        assert "did you mean" not in err.value.problems[0]
