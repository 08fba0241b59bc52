"""The user's own config folders: `--config-dir`, TRAINCTL_CONFIG_PATH and `recipe=path.yaml`."""

from __future__ import annotations

import pytest

from tests.helpers import run_cli
from trainctl.config.compose import compose, list_options, recipe_description
from trainctl.config.errors import ConfigError
from trainctl.config.sources import ENV_VAR, SearchPath, options, search_path, shadowed

SMALL_MODEL = """name: small
dim: 64
n_layers: 2
n_heads: 4
n_kv_heads: 2
ffn_dim: 176
vocab_size: 256
max_seq_len: 256
"""

RECIPE = """# @package _global_
# My own recipe on my own model.
defaults:
  - override /model: small
recipe: mine
train:
  steps: 30
"""


def folder(root, files: dict[str, str]):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.fixture
def user_dir(tmp_path):
    return folder(tmp_path / "mine", {"model/small.yaml": SMALL_MODEL, "recipes/mine.yaml": RECIPE})


def test_a_user_folder_adds_recipes_and_group_options(user_dir):
    sp = search_path([str(user_dir)], environ={})
    assert "mine" in list_options("recipe", sp) and "tiny_cpu" in list_options("recipe", sp)
    assert "small" in list_options("model", sp)
    cfg = compose(["recipe=mine"], sp)
    assert (cfg.model.dim, cfg.train.steps, cfg.recipe) == (64, 30, "mine")
    assert recipe_description("mine", sp) == "My own recipe on my own model."
    assert options("model", sp)["small"].path == user_dir / "model" / "small.yaml"


def test_without_the_folder_its_options_do_not_exist(user_dir):
    assert "mine" not in list_options("recipe")
    with pytest.raises(ConfigError) as err:
        compose(["recipe=mine"])
    assert err.value.problems[0].startswith("recipe=mine: unknown recipe")


def test_the_environment_variable_adds_folders_after_the_command_line(tmp_path, user_dir):
    other = folder(tmp_path / "other", {"model/small.yaml": SMALL_MODEL.replace("dim: 64", "dim: 128")})
    from_env = search_path([], environ={ENV_VAR: f"{other}"})
    assert compose(["model=small"], from_env).model.dim == 128
    both = search_path([str(user_dir)], environ={ENV_VAR: f"{other}"})
    assert compose(["model=small"], both).model.dim == 64  # --config-dir first


def test_a_user_option_shadowing_a_shipped_one_wins_and_is_named(tmp_path):
    mine = folder(tmp_path / "mine", {"model/tiny.yaml": SMALL_MODEL.replace("name: small", "name: tiny")})
    sp = search_path([str(mine)], environ={})
    assert compose([], sp).model.dim == 64
    ((winner, hidden),) = shadowed(sp)
    assert (winner.group, winner.name, winner.shipped, hidden.shipped) == ("model", "tiny", False, True)


def test_user_options_are_validated_like_shipped_ones(tmp_path):
    bad = folder(tmp_path / "bad", {"model/wide.yaml": SMALL_MODEL.replace("dim: 64", "dimm: 64"),
                                    "recipes/odd.yaml": "# @package _global_\ntrain:\n  steps: many\n"})
    sp = search_path([str(bad)], environ={})
    with pytest.raises(ConfigError) as err:
        compose(["model=wide"], sp)
    assert "dimm" in err.value.problems[0] and str(bad / "model" / "wide.yaml") in err.value.problems[0]
    with pytest.raises(ConfigError) as err:
        compose(["recipe=odd"], sp)
    assert "'many'" in err.value.problems[0] and str(bad / "recipes" / "odd.yaml") in err.value.problems[0]


def test_only_group_folders_of_declared_folders_load(tmp_path, user_dir):
    # A folder's own config.yaml and stray files never load; neither does a sibling of a declared folder.
    folder(user_dir, {"config.yaml": "train:\n  steps: 999\n", "notes.yaml": "x: 1\n"})
    folder(tmp_path, {"model/sibling.yaml": SMALL_MODEL})
    sp = search_path([str(user_dir)], environ={})
    assert compose([], sp).train.steps == compose([]).train.steps
    assert "sibling" not in list_options("model", sp)
    for override in ("model=../sibling", f"model={tmp_path}/model/sibling"):
        with pytest.raises(ConfigError):
            compose([override], sp)


def test_missing_folders_are_each_one_line(tmp_path):
    with pytest.raises(ConfigError) as err:
        search_path([str(tmp_path / "nope")], environ={ENV_VAR: str(tmp_path / "gone")})
    assert len(err.value.problems) == 2
    assert err.value.problems[0].startswith("--config-dir") and "does not exist" in err.value.problems[0]
    assert err.value.problems[1].startswith(ENV_VAR)


def test_a_recipe_file_by_path_uses_the_folders_options(user_dir):
    sp = search_path([str(user_dir)], environ={})
    recipe = user_dir.parent / "elsewhere.yaml"
    recipe.write_text(RECIPE.replace("steps: 30", "steps: 12").replace("recipe: mine", "recipe: elsewhere"))
    cfg = compose([f"recipe={recipe}"], sp)
    assert (cfg.model.dim, cfg.train.steps) == (64, 12)
    with pytest.raises(ConfigError) as err:
        compose([f"recipe={recipe}"], SearchPath())  # its model lives in a folder not declared
    assert "model=small: unknown model" in err.value.problems[0]


@pytest.mark.cli
def test_the_cli_takes_config_dirs_and_says_where_options_come_from(user_dir, tmp_path):
    listed = run_cli("recipes", "--config-dir", str(user_dir), cwd=tmp_path, timeout=120)
    assert listed.returncode == 0, listed.stderr
    rows = [line.split("\t") for line in listed.stdout.splitlines()]
    assert ["mine", "My own recipe on my own model.", str(user_dir / "recipes" / "mine.yaml")] in rows
    assert ["tiny_cpu", "shipped"] == [rows[-1][0], rows[-1][2]]
    planned = run_cli("plan", "recipe=mine", "--config-dir", str(user_dir), "--json", cwd=tmp_path, timeout=120)
    assert planned.returncode == 0, planned.stderr
    missing = run_cli("plan", "--config-dir", str(tmp_path / "nope"), cwd=tmp_path, timeout=120)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert missing.stderr.strip().count("\n") == 0
