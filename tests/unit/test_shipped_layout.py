"""In a checkout the shipped configs are the top-level conf/ and recipes/, read there and kept nowhere else."""

from __future__ import annotations

from tests.helpers import REPO
from trainctl.config import sources
from trainctl.config.schema import GROUPS


def test_a_checkout_reads_the_top_level_conf_and_recipes():
    assert sources.shipped_dir() == REPO / "conf" and sources.shipped_recipes_dir() == REPO / "recipes"
    cat = sources.catalog(sources.SearchPath())
    assert cat.primary == REPO / "conf" / "config.yaml"
    for group in GROUPS:
        folder = REPO / "conf" / group
        assert {name: opt.path for name, opt in cat.groups[group].items()} == {
            p.stem: p for p in folder.glob("*.yaml")}, group
    recipes = cat.groups[sources.RECIPE]
    assert {name: opt.path for name, opt in recipes.items()} == {p.stem: p for p in (REPO / "recipes").glob("*.yaml")}
    assert "tiny_cpu" in recipes and all(opt.shipped for opt in recipes.values())


def test_every_group_of_the_schema_has_its_top_level_folder():
    assert sorted(p.name for p in (REPO / "conf").iterdir() if p.is_dir()) == sorted(GROUPS)


def test_the_package_folder_holds_no_config_of_its_own():
    """A copy inside trainctl/ would be read instead of conf/ and recipes/ (that is how a wheel is told apart)."""
    assert sorted((REPO / "trainctl").rglob("*.y*ml")) == []
    assert not (REPO / "trainctl" / "conf").exists() and not (REPO / "trainctl" / "recipes").exists()


def test_a_package_holding_conf_is_read_as_a_built_wheel_is(tmp_path):
    package = tmp_path / "site" / "trainctl"
    package.mkdir(parents=True)
    assert sources.shipped_base(package) == package.parent  # a checkout: conf/ and recipes/ beside the package
    (package / "conf").mkdir()
    (package / "conf" / "config.yaml").write_text("defaults: []\n")
    assert sources.shipped_base(package) == package  # a wheel: the build copied them in


def test_naming_the_shipped_folders_as_config_dirs_adds_nothing():
    sp = sources.search_path([str(REPO / "conf"), str(REPO)], environ={})
    assert sp.user_dirs == () and sources.shadowed(sp) == []
