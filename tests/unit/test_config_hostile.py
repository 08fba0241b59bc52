"""Hostile or careless config files: one ConfigError line naming the file or key, never an escape, a hang or a
traceback (overrides on the command line: test_config_hostile_overrides.py).

- A defaults list (of a recipe, a recipe file named by path, or a group option) can only name the declared
  folders' options, by plain name: `..`, absolute paths, Hydra's own package and interpolations are refused
  naming the file and the entry, and nothing outside is read.
- YAML is read bounded (yaml_files): nested aliases ("billion laughs"), self-containing aliases, deep nesting,
  syntax errors, language tags, NUL bytes, other encodings: one line with the file, line and column.
- Interpolations that expand without end are refused, in a recipe, on the command line and in a run's config.yaml.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.unit.hostile_config import deadline, refused, write
from trainctl.config import yaml_files
from trainctl.config.compose import compose
from trainctl.config.errors import ConfigError
from trainctl.config.hydra_source import TrainctlSource, initialize_catalog
from trainctl.config.load import load_run_config, to_yaml
from trainctl.config.sources import catalog, search_path

EVIL_MODEL = "name: evil\ndim: 64\nn_layers: 2\nn_heads: 4\nn_kv_heads: 2\nffn_dim: 176\nmax_seq_len: 256\n"
UP = "../" * 40  # from any folder up to the root


def recipe(defaults_entry: str) -> str:
    return f"# @package _global_\ndefaults:\n  - {defaults_entry}\nrecipe: r\n"


@pytest.fixture
def evil(tmp_path):
    """A model YAML outside every config folder; any escape would load it."""
    return write(tmp_path / "outside", {"evil.yaml": EVIL_MODEL}) / "evil.yaml"


def escaping_entries(evil: Path) -> list[str]:
    rel, bare = f"{UP}{str(evil.with_suffix('')).lstrip('/')}", str(evil.with_suffix(""))
    return [
        f"override /model: {rel}",  # up from the group folder
        f"override /model: {bare}",  # an absolute path
        f"/model@model: {rel}",
        f"{rel}@model",  # a config named by path
        f"model@_global_: {rel}",  # a group relative to the recipe's own folder
        f"override /model: tiny/{rel}",  # through a listed option's file
        f"/hydra/{rel}@model",  # through Hydra's own package (pkg://hydra.conf resolves `..` too)
        "override /model: ${oc.env:EVIL_OPTION}",  # an interpolation resolved to a path
    ]


# ---------------------------------------------------------------- 1. defaults entries cannot escape


@pytest.mark.parametrize("index", range(8))
def test_a_recipes_defaults_entry_cannot_load_a_file_outside_the_folders(tmp_path, evil, monkeypatch, index):
    entry = escaping_entries(evil)[index]
    monkeypatch.setenv("EVIL_OPTION", f"{UP}{str(evil.with_suffix('')).lstrip('/')}")
    mine = write(tmp_path / "mine", {"recipes/r.yaml": recipe(entry)})
    line = refused(["recipe=r"], search_path([str(mine)], environ={}))
    assert line.startswith(f"{mine / 'recipes' / 'r.yaml'}: defaults entry ")
    assert entry.split(":")[0].split("@")[0][:20] in line


@pytest.mark.parametrize("index", range(8))
def test_a_recipe_file_named_by_path_cannot_reach_further(tmp_path, evil, monkeypatch, index):
    monkeypatch.setenv("EVIL_OPTION", f"{UP}{str(evil.with_suffix('')).lstrip('/')}")
    file = write(tmp_path, {"elsewhere/r.yaml": recipe(escaping_entries(evil)[index])}) / "elsewhere" / "r.yaml"
    assert refused([f"recipe={file}"]).startswith(f"{file}: defaults entry ")


@pytest.mark.parametrize("index", range(8))
def test_a_group_options_own_defaults_cannot_escape_either(tmp_path, evil, monkeypatch, index):
    monkeypatch.setenv("EVIL_OPTION", f"{UP}{str(evil.with_suffix('')).lstrip('/')}")
    entry = escaping_entries(evil)[index].replace("override ", "")
    mine = write(tmp_path / "mine", {"model/nest.yaml": f"defaults:\n  - {entry}\n  - _self_\nname: nest\n",
                                     "recipes/r.yaml": recipe("override /model: nest")})
    sp = search_path([str(mine)], environ={})
    for overrides in (["model=nest"], ["recipe=r"]):
        assert refused(overrides, sp).startswith(f"{mine / 'model' / 'nest.yaml'}: defaults entry ")


def test_hydra_is_served_only_the_listed_options_by_name(tmp_path):
    """The source behind every composition: a path that is not GROUP/NAME of a listed option does not exist."""
    mine = write(tmp_path / "mine", {"model/small.yaml": "name: small\n"})
    with initialize_catalog(catalog(search_path([str(mine)], environ={}))) as init:
        source = TrainctlSource("main", f"trainctl://{init.token}")
        assert source.is_config("model/small") and source.is_config("model/tiny") and source.is_config("config")
        for path in ("model/small/../tiny", "model/../model/small", f"model/{UP}{str(mine).lstrip('/')}/model/small",
                     "model/small.yaml/../../model/small", "small", "recipes/tiny_cpu", "model/", ""):
            assert not source.is_config(path), path
        assert source.list("model", None) == sorted([*source.catalog.groups["model"]])


def test_entries_that_name_the_folders_options_still_compose(tmp_path):
    mine = write(tmp_path / "mine", {
        "model/small.yaml": "name: small\ndim: 64\nn_heads: 4\n",
        "recipes/base.yaml": "# @package _global_\ndefaults:\n  - override /model: small\ntrain:\n  steps: 7\n",
        "recipes/top.yaml": "# @package _global_\ndefaults:\n  - base\n  - override /schedule: wsd\n"
                            "  - override /precision: bf16\n  - _self_\nrecipe: top\n"})
    cfg = compose(["recipe=top"], search_path([str(mine)], environ={}))
    assert (cfg.model.dim, cfg.precision.compute_dtype, cfg.train.steps, cfg.schedule.name) == (64, "bf16", 7, "wsd")


# ---------------------------------------------------------------- 2. bounded YAML


def laughs(levels: int = 9) -> str:
    lines = ["l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("where", ["recipes/r.yaml", "model/small.yaml"])
def test_nested_aliases_in_a_config_file_are_refused_not_expanded(tmp_path, where):
    text = ("# @package _global_\n" if where.startswith("recipes") else "") + laughs()
    mine = write(tmp_path / "mine", {where: text})
    line = refused(["recipe=r" if where.startswith("recipes") else "model=small"], search_path([str(mine)], environ={}))
    assert line.startswith(f"{mine / where}:") and "aliases expand to more than" in line


def test_nested_aliases_in_a_runs_config_yaml_are_refused_not_expanded(tmp_path):
    (tmp_path / "config.yaml").write_text(to_yaml(compose([])) + laughs())
    with deadline(20), pytest.raises(ValueError) as err:  # ConfigFileError: readers that catch ValueError see it
        load_run_config(tmp_path)
    # The line leaves the file to the reader that names it (resume, export, the worker): where in it, and why.
    assert isinstance(err.value, ConfigError) and "\n" not in str(err.value)
    assert str(err.value).startswith("line ") and "aliases expand to more than" in str(err.value)


def test_a_few_aliases_are_fine(tmp_path):
    text = "# @package _global_\ntrain:\n  steps: &s 12\n  eval_every: *s\n"
    mine = write(tmp_path / "mine", {"recipes/r.yaml": text})
    cfg = compose(["recipe=r"], search_path([str(mine)], environ={}))
    assert (cfg.train.steps, cfg.train.eval_every) == (12, 12)


@pytest.mark.parametrize(("text", "fragment"), [
    ("train: &x\n  steps: *x\n", "an alias refers to a node that contains it"),
    ("train:\n  steps: " + "[" * 40 + "]" * 40 + "\n", "nested more than"),
    ("train:\n  steps: " + "[" * 2000 + "]" * 2000 + "\n", "nested more than"),
    ("train:\n  steps: 'open\n", ":4:1: not valid YAML: while scanning a quoted scalar"),
    ("train:\n  steps: 3\n   seq_len: 4\n", ":4:11: not valid YAML: mapping values are not allowed here"),
    ("train: !!python/object/apply:os.system [echo]\n", ":2:8: not valid YAML: could not determine a constructor"),
    ("train:\n  steps: 1\ntrain:\n  steps: 2\n", ":4:1: not valid YAML: while constructing a mapping: found duplicate"),
    ("train:\n  steps: 3\x00\n", ":3:11: not valid YAML: unacceptable character #x0000"),
    ("train:\n\tsteps: 3\n", ":3:1: not valid YAML: while scanning for the next token"),
    ("a: 1\n---\nb: 2\n", ":3:1: not valid YAML: expected a single document"),
    ("? [a, b]\n: x\n", "not valid YAML: while constructing a mapping: found unhashable key"),
    ("train:\n  steps: " + "9" * 5000 + "\n", "a value cannot be read (Exceeds the limit"),
    ("null: 3\n", "the key None is not a name"),
    ("train:\n  3: 4\n", "the key 3 is not a name"),
    ("- a\n- b\n", "holds a list; a config file is a mapping"),
    ("hello\n", "holds the single value 'hello'"),
    ("hydra:\n  job:\n    chdir: true\n", "hydra: Hydra's own settings cannot be set"),
    ("defaults:\n  model: tiny\n", "defaults: must be a list"),
    ("defaults:\n  - _self_\n  - _self_\n", "_self_ appears more than once"),
    ("defaults:\n  - override /nosuch: x\n", "'/nosuch' is not a group of trainctl"),
    ("defaults:\n  - override /model: [tiny, ../x]\n", "'../x' is not an option name"),
    ("defaults:\n  - {a: 1, b: 2}\n", "an entry is"),
    ("defaults:\n  - always /model: tiny\n", "unknown keyword"),
    ("defaults:\n  - override /model@hydra.job: tiny\n", "writes Hydra's own settings"),
])
def test_a_broken_recipe_is_one_line_naming_the_file(tmp_path, text, fragment):
    mine = write(tmp_path / "mine", {"recipes/r.yaml": "# @package _global_\n" + text})
    line = refused(["recipe=r"], search_path([str(mine)], environ={}))
    assert line.startswith(f"{mine / 'recipes' / 'r.yaml'}") and fragment in line, line


@pytest.mark.parametrize(("header", "fragment"), [
    ("# @package _global_ extra", "Too many components"),
    ("# @package hydra", "writes Hydra's own settings"),
    ("# @package _global_.hydra.job", "writes Hydra's own settings"),
])
def test_a_bad_package_header_is_one_line_naming_the_file(tmp_path, header, fragment):
    mine = write(tmp_path / "mine", {"recipes/r.yaml": f"{header}\ntrain:\n  steps: 3\n"})
    line = refused(["recipe=r"], search_path([str(mine)], environ={}))
    assert line.startswith(str(mine / "recipes" / "r.yaml")) and fragment in line


def test_a_file_in_another_encoding_names_its_line(tmp_path):
    mine = tmp_path / "mine"
    (mine / "recipes").mkdir(parents=True)
    (mine / "recipes" / "r.yaml").write_bytes(b"# @package _global_\ndescription: caf\xe9\n")
    assert refused(["recipe=r"], search_path([str(mine)], environ={})).startswith(
        f"{mine / 'recipes' / 'r.yaml'}:2: not UTF-8")


def test_an_empty_recipe_and_one_without_a_header_are_global(tmp_path):
    mine = write(tmp_path / "mine", {"recipes/empty.yaml": "", "recipes/bare.yaml": "train:\n  steps: 9\n",
                                     "recipes/bom.yaml": "\ufeff# @package _global_\ntrain:\n  steps: 8\n"})
    sp = search_path([str(mine)], environ={})
    assert compose(["recipe=empty"], sp) == compose([], sp)
    assert compose(["recipe=bare"], sp).train.steps == 9
    assert compose(["recipe=bom"], sp).train.steps == 8  # a byte-order mark from an editor


@pytest.mark.parametrize(("files", "start"), [
    ({"recipes/r.yaml": "# @package _global_\ndefaults:\n  - r\n"}, "recipe/r -> recipe/r"),
    ({"recipes/r.yaml": "# @package _global_\ndefaults:\n  - s\n",
      "recipes/s.yaml": "# @package _global_\ndefaults:\n  - /recipe/r\n"}, "recipe/r -> recipe/s -> recipe/r"),
])
def test_a_recipe_that_includes_itself_is_one_line(tmp_path, files, start):
    mine = write(tmp_path / "mine", files)
    line = refused(["recipe=r"], search_path([str(mine)], environ={}))
    assert line.startswith(f"{mine / 'recipes' / 'r.yaml'}: its defaults include it again ({start})")


def test_an_option_that_includes_its_own_group_is_one_line(tmp_path):
    mine = write(tmp_path / "mine", {"model/nest.yaml": "defaults:\n  - /model@_here_: tiny\n  - _self_\nname: nest\n",
                                     "recipes/r.yaml": recipe("override /model: nest")})
    sp = search_path([str(mine)], environ={})
    for overrides in (["model=nest"], ["recipe=r"]):
        line = refused(overrides, sp)
        assert line.startswith(f"{mine / 'model' / 'nest.yaml'}: its defaults name an option of its own group model")


def test_a_fifo_or_a_folder_is_never_opened(tmp_path):
    path = tmp_path / "pipe.yaml"
    os.mkfifo(path)
    with deadline(10), pytest.raises(ConfigError) as err:
        yaml_files.load(path)  # a FIFO opened for reading would wait for a writer
    assert "not a regular file" in err.value.problems[0]
    with pytest.raises(ConfigError) as err:
        yaml_files.load(tmp_path)
    assert "not a regular file" in err.value.problems[0]
    big = tmp_path / "big.yaml"
    big.write_text("a: 1\n" * (yaml_files.MAX_BYTES // 4))
    with pytest.raises(ConfigError) as err:
        yaml_files.load(big)
    assert "larger than" in err.value.problems[0]


def test_odd_files_in_a_config_folder_are_not_options(tmp_path):
    mine = write(tmp_path / "mine", {"recipes/ok.yaml": "# @package _global_\n"})
    os.mkfifo(mine / "recipes" / "pipe.yaml")
    (mine / "recipes" / "dir.yaml").mkdir()
    (mine / "recipes" / "dangling.yaml").symlink_to(tmp_path / "nowhere.yaml")
    (mine / "recipes" / "a..b.yaml").write_text("")
    sp = search_path([str(mine)], environ={})
    for name in ("pipe", "dir", "dangling", "a..b"):
        assert refused([f"recipe={name}"], sp).startswith(f"recipe={name}: ")
    with deadline(10):
        assert compose(["recipe=ok"], sp) == compose([], sp)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode")
def test_an_unreadable_option_is_one_line(tmp_path):
    mine = write(tmp_path / "mine", {"recipes/r.yaml": "# @package _global_\n"})
    (mine / "recipes" / "r.yaml").chmod(0)
    assert "cannot be read" in refused(["recipe=r"], search_path([str(mine)], environ={}))


def interpolation_laughs(levels: int = 40) -> list[tuple[str, str]]:
    """cluster.env keys each referring twice to the one before: 2^levels resolutions if resolved."""
    return [("a0", "lol")] + [(f"a{i}", f"${{cluster.env.a{i - 1}}}${{cluster.env.a{i - 1}}}")
                              for i in range(1, levels + 1)]


def test_interpolations_that_expand_without_end_are_refused_in_a_recipe_and_on_the_command_line(tmp_path):
    body = "".join(f"    {key}: '{value}'\n" for key, value in interpolation_laughs())
    mine = write(tmp_path / "mine", {"recipes/r.yaml": f"# @package _global_\ncluster:\n  env:\n{body}"})
    line = refused(["recipe=r"], search_path([str(mine)], environ={}))
    assert line.startswith("cluster.env.a40: its ${...} references expand to ") and "write the value out" in line
    overrides = [f"+cluster.env.{key}='{value}'" for key, value in interpolation_laughs()]
    assert refused(overrides).startswith("cluster.env.a40: its ${...} references expand to ")


def test_interpolations_that_expand_without_end_in_a_runs_config_yaml_are_refused(tmp_path):
    env = "".join(f"    {key}: '{value}'\n" for key, value in interpolation_laughs())
    text = to_yaml(compose(["cluster=slurm"])).replace("  env: {}\n", f"  env:\n{env}")  # env: a Slurm key
    assert "a40" in text
    (tmp_path / "config.yaml").write_text(text)
    with deadline(20), pytest.raises(ValueError) as err:
        load_run_config(tmp_path)
    assert str(err.value).startswith("cluster.env.a40: its ${...} references")


def test_ordinary_interpolations_still_resolve():
    cfg = compose(["cluster=slurm", "+cluster.env.STEPS=${train.steps}",
                   "description=${cluster.env.STEPS}-${.name}x-\\${kept}",
                   "train.eval_every=${oc.select:train.steps,1}"])
    assert (cfg.cluster.env["STEPS"], cfg.description, cfg.train.eval_every) == ("100", "100-x-${kept}", 100)
