"""A sweep's grid (launch/grid.py): Hydra's grammar expanded like Hydra's basic sweeper, but bounded, and every
problem one line naming the override (never a hang, a ValueError, a decimal error or an OmegaConf error)."""

from __future__ import annotations

import pytest
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser

from tests.helpers import cli_in_process, deadline
from trainctl.config.errors import ConfigError
from trainctl.launch.grid import MAX_POINTS
from trainctl.launch.sweep import expand


def refused(grid: list[str], **kwargs) -> str:
    """The one line expand refuses `grid` with, within a deadline."""
    with deadline(10), pytest.raises(ConfigError) as err:
        expand(grid, **kwargs)
    assert len(err.value.problems) == 1 and "\n" not in err.value.problems[0]
    return err.value.problems[0]


@pytest.mark.parametrize("grid", [
    ["a=1,2", "b=x,y,z"], ["a=range(0,3)"], ["a=range(0,1,0.1)"], ["a=range(1,0,-0.25)"], ["a=range(0.5,3)"],
    ["a=choice(1,2)", "+b=3"], ["a=1,2", "a=3,4"], ["a@pkg=1,2"], ["a=sort(3,1,2)"], ["a=range(5,0,-2)"],
    ["a=[1,2],[3]"], ["a='x,y',z"], ["a={b:1},{c:2}"], ["a=1e3,2"], ["~a", "b=1,2"],
])
def test_a_grid_expands_as_hydras_basic_sweeper_does(grid):
    parsed = OverridesParser.create().parse_overrides(grid)
    assert expand(grid) == [list(p) for batch in BasicSweeper.split_arguments(parsed, None) for p in batch]


@pytest.mark.parametrize("value", ["{}", "[{}]", "{a:{}}", "[]", "[[{}],{}]"])
def test_empty_maps_and_lists_are_values_a_sweep_can_take(value):
    assert expand([f"train.seed={value},1"]) == [[f"train.seed={value}"], ["train.seed=1"]]


@pytest.mark.parametrize("item", ["train.seed=range(0,1e300)", "train.seed=range(0,100000000)",
                                  "train.seed=shuffle(range(0,1e12))", "train.seed=sort(range(0,1e300))"])
def test_a_huge_range_is_refused_before_it_is_listed(item):
    # Hydra's basic sweeper lists every value first: these ran for ever (or until memory ran out).
    line = refused([item])
    assert line.startswith(f"{item}: ") and f"at most {MAX_POINTS} points" in line


@pytest.mark.parametrize("item", ["a=range(0,10,0)", "a=range(nan,3)", "a=range(0,inf)", "a=range(-inf,inf,1)",
                                  "a=range(0,1,nan)"])
def test_a_range_without_an_end_or_a_step_is_one_line(item):
    # A ValueError (step 0), decimal.InvalidOperation (nan) or a loop without end (inf) before.
    assert refused([item]) == (f"{item}: range(start,stop,step) needs finite numbers and a step other than 0, "
                               "e.g. range(0,10,2)")


def test_a_cross_product_past_the_bound_is_refused_without_building_it():
    forty = ",".join(str(i) for i in range(40))
    line = refused(["a=1,2", f"b={forty}", f"c={forty}"])
    assert line.startswith("-m: 3200 points (a (2) x b (40) x c (40)); a sweep has at most")
    assert len(expand([f"b=range(0,{MAX_POINTS})"])) == MAX_POINTS  # the bound itself is a sweep


@pytest.mark.parametrize(("item", "fragment"), [
    ("a=range(0,3),1", "a range() or choice() inside a list of values"),  # OmegaConf's 'Set[str]' before
    ("a=sort(1,{})", "Invalid arguments: (1, {})"),
    ("a=int(inf),1", "cannot convert float infinity to integer"),
    ("a=interval(0,1)", "interval() needs a sampling sweeper"),
    ("a=range(1,2,3,4)", "too many positional arguments"),
    ("train.seed=range(5,0)", "the sweep has no points"),
])
def test_each_refusal_names_its_override_and_says_why(item, fragment):
    line = refused(["recipe=tiny_cpu", item, "train.steps=1,2"])
    assert line.startswith(f"{item}: ") and fragment in line and "Error parsing override" not in line


def test_every_bad_override_is_named_at_once():
    with pytest.raises(ConfigError) as err:
        expand(["a=range(0,10,0)", "b=1,2", "c=sort(1,{})"])
    assert [p.split(":")[0] for p in err.value.problems] == ["a=range(0,10,0)", "c=sort(1,{})"]


def test_glob_picks_a_groups_options():
    options = {"model": ["tiny", "tinier", "llama3_8b"]}
    assert expand(["model=glob(tin*)"], group_options=options.get) == [["model=tinier"], ["model=tiny"]]
    assert "glob() picks a config group's options" in refused(["model=glob(*)"])  # 'ConfigLoader is not set' before
    assert "glob() picks a config group's options" in refused(["train.seed=glob(*)"], group_options=options.get)


def test_launch_m_globs_the_config_folders_and_refuses_a_huge_range_writing_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    runs = tmp_path / "runs"

    def launch(*overrides: str) -> tuple[int, str]:
        with deadline(60):
            code, _, err = cli_in_process(monkeypatch, capsys, "launch", "-m", "--dry-run", "recipe=tiny_cpu",
                                          f"runs_dir={runs}", *overrides)
        return code, err

    code, err = launch("train.seed=range(0,1e300)")
    assert code == 2 and err.startswith("error: train.seed=range(0,1e300): ") and not runs.exists()
    code, err = launch("optim=glob(adam*)")
    assert code == 0, err
    assert [p.name for p in (runs / "sweeps").iterdir()]
