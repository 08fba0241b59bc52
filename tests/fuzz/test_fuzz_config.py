"""Generated overrides and recipe files: every one composes, or is refused as a user error; none hangs, none leaves
its temporary overlay behind, none composes in a YAML from outside the declared folders."""

from __future__ import annotations

import dataclasses
import string

from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.guard import BOUNDED, USER_ERRORS, deadline, overlays_left
from trainctl.config import compose as composer
from trainctl.config import sources
from trainctl.config.schema import GROUPS, RunConfig
from trainctl.config.validate import resolve
from trainctl.launch.grid import MAX_POINTS
from trainctl.launch.sweep import expand
from trainctl.plan import build


def leaf_keys(cls=RunConfig, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            keys += leaf_keys(type(default), f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


KEYS = leaf_keys()
WEIRD = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12)
SCALARS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["true", "false", "null", "''", "~", "-1", "0", "1e23", "nan", "inf", "${oc.env:HOME}", "${x",
                     "\\${x}", "range(0,3)", "choice(a,b)", "interval(0,1)", "[]", "{}", "[[[[1]]]]", "{a:{b:1}}"]),
    st.text(alphabet=string.ascii_letters + string.digits + "_-./ ,[]{}:=$'\"\\", max_size=16),
    WEIRD,
)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3).map(lambda xs: "[" + ",".join(xs) + "]"),
                      max_leaves=6)
KEY_TEXT = st.one_of(st.sampled_from(KEYS), st.sampled_from([*GROUPS, "recipe", "hydra", "hydra.run.dir"]),
                     st.from_regex(r"[a-z_]{1,10}(\.[a-z_]{1,10}){0,3}", fullmatch=True), WEIRD)
OVERRIDE = st.builds(lambda prefix, key, value: f"{prefix}{key}={value}",
                     st.sampled_from(["", "", "", "+", "++", "~"]), KEY_TEXT, VALUES)
GROUP_PICK = st.one_of(st.builds(lambda g, o: f"{g}={o}", st.sampled_from(GROUPS),
                                 st.sampled_from(["tiny", "bf16", "fsdp", "cosine", "slurm", "memmap", "synthetic",
                                                  "../x", "/etc/passwd", "", "a,b"])),
                       st.sampled_from(["recipe=tiny_cpu", "recipe=llama7b_fsdp", "recipe=llama70b_3d", "recipe=x.yaml",
                                        "recipe=../../etc/passwd"]))


def plan_or_refuse(overrides: list[str]) -> None:
    """Compose, validate and plan; a user error is a fine answer, anything else fails the example."""
    try:
        build(resolve(composer.compose(overrides)))
    except USER_ERRORS:
        pass


@BOUNDED
@given(st.lists(st.one_of(OVERRIDE, GROUP_PICK), max_size=5))
def test_any_overrides_compose_or_are_refused_as_user_errors(overrides):
    before = overlays_left()
    with deadline(30):
        plan_or_refuse(["recipe=tiny_cpu", *overrides])
    assert overlays_left() <= before  # the temporary overlay never stays


@BOUNDED
@given(st.lists(st.builds(lambda k, vs: f"{k}={','.join(vs)}", st.sampled_from(KEYS), st.lists(SCALARS, max_size=4)),
                max_size=3))
def test_any_sweep_grid_expands_or_is_refused(grid):
    with deadline(30):
        try:
            expand(grid)
        except USER_ERRORS:
            pass


NUMBERS = st.one_of(st.integers(-(2**70), 2**70).map(str), st.floats().map(repr),
                    st.sampled_from(["0", "-0", "1e300", "-1e300", "1e-300", "nan", "inf", "-inf", "{}", "[]", "x"]))
SWEEP_CALLS = st.builds(lambda name, args: f"{name}({','.join(args)})",
                        st.sampled_from(["range", "shuffle", "sort", "choice", "glob", "interval", "tag", "int",
                                         "float", "str", "bool"]),
                        st.lists(st.one_of(NUMBERS, st.sampled_from(["range(0,3)", "range(0,1e300)", "reverse=true",
                                                                     "list=[1,{}]", "*"])), max_size=4))


@BOUNDED
@given(st.lists(st.builds(lambda k, vs: f"{k}={','.join(vs)}", st.sampled_from([*KEYS, "model", "recipe"]),
                          st.lists(st.one_of(SWEEP_CALLS, SCALARS), min_size=1, max_size=3)), max_size=3))
def test_any_sweep_function_expands_within_the_bound_or_is_refused(grid):
    # range() of a huge, infinite or NaN extent, a zero step, sweeps inside lists, glob() on any key
    with deadline(30):
        try:
            points = expand(grid, group_options=lambda group: ["tiny", "tinier", group])
        except USER_ERRORS:
            return
    assert len(points) <= MAX_POINTS


MARKER = "fuzz_outside_marker_17"
YAML_SCALARS = st.one_of(st.integers(-5, 10**6), st.floats(allow_nan=False, width=32), st.booleans(), st.none(),
                         st.text(alphabet=string.ascii_letters + "_-./$ {}", max_size=10))


def yaml_value(depth: int = 2):
    if depth == 0:
        return YAML_SCALARS
    keys = st.sampled_from(["dim", "steps", "lr", "name", "x", "_self_"])
    return st.one_of(YAML_SCALARS, st.lists(yaml_value(depth - 1), max_size=3),
                     st.dictionaries(keys, yaml_value(depth - 1), max_size=3))


DEFAULTS_ENTRY = st.sampled_from([
    "_self_", "override /model: tiny", "override /model: ../outside/evil", "override /model: {out}/evil",
    "/model@_global_: ../../outside/evil", "/recipe: mine", "/recipe: other", "override /sharding: fsdp",
    "optional /model: ../../../outside/evil", "override hydra/launcher: x", "/nonexistent: y",
])


@st.composite
def recipe_texts(draw):
    """A recipe file: maybe a defaults list (entries reaching out of the folder among them), keys, YAML tricks."""
    lines = ["# @package _global_"] if draw(st.booleans()) else []
    entries = draw(st.lists(DEFAULTS_ENTRY, max_size=4))
    if entries:
        lines += ["defaults:"] + [f"  - {e}" for e in entries]
    body = draw(st.dictionaries(st.sampled_from(["train", "model", "optim", "recipe", "description", "hydra", "zzz"]),
                                yaml_value(), max_size=3))
    import yaml

    lines.append(yaml.safe_dump(body) if body else "")
    trick = draw(st.sampled_from(["", "a: &a [1, 2]\nb: [*a, *a]\n", "x: !!python/name:os.system\n", "k: [unclosed\n",
                                  "\t- tab\n", "%YAML 9.9\n---\n", "- list\n"]))
    return "\n".join(lines) + "\n" + trick


@BOUNDED
@given(recipe_texts(), recipe_texts())
def test_any_recipe_file_composes_or_is_refused_and_never_reaches_outside(tmp_path_factory, mine, other):
    root = tmp_path_factory.mktemp("conf")
    outside = root.parent / f"{root.name}-outside"
    outside.mkdir()
    (outside / "evil.yaml").write_text(f"# @package _global_\ndescription: {MARKER}\n")
    (root / "recipes").mkdir()
    (root / "recipes" / "mine.yaml").write_text(mine.replace("{out}", str(outside)).replace("../outside",
                                                                                            f"../../{outside.name}"))
    (root / "recipes" / "other.yaml").write_text(other.replace("{out}", str(outside)))
    before = overlays_left()
    with deadline(30):
        try:
            sp = sources.search_path([str(root)])
            cfg = composer.compose(["recipe=mine"], sp)
        except USER_ERRORS:
            cfg = None
    assert overlays_left() <= before
    assert cfg is None or MARKER not in cfg.description, "a YAML outside the declared folders was composed in"


OPTIONS = {group: composer.list_options(group) for group in composer.config_groups()}
REAL_PICK = st.sampled_from(sorted(OPTIONS)).flatmap(lambda g: st.sampled_from(OPTIONS[g]).map(lambda o: f"{g}={o}"))
PLAIN_VALUE = st.sampled_from(["1", "2", "0.5", "1e-4", "true", "x", "[1,2]", "null", "64", "bf16", "{a:1}", "''"])
KEY_VALUE = st.one_of(st.builds(lambda p, k, v: f"{p}{k}={v}", st.sampled_from(["", "", "+", "++"]),
                                st.sampled_from(KEYS), PLAIN_VALUE), st.sampled_from(KEYS).map(lambda k: f"~{k}"))


@BOUNDED
@given(st.lists(st.one_of(OVERRIDE, GROUP_PICK, REAL_PICK, KEY_VALUE), max_size=5))
def test_composing_the_groups_first_is_composing_all_at_once(overrides):
    # compose_dictconfig composes the group choices (cached) and then applies the key=value overrides, as Hydra
    # does inside one compose: the same tree, or the same refusal, for any overrides.
    with deadline(60):
        split = composition(composer.compose_dictconfig, ["recipe=tiny_cpu", *overrides])
        whole = composition(all_at_once, ["recipe=tiny_cpu", *overrides])
    assert split == whole


def all_at_once(overrides: list[str]):
    """compose_dictconfig's steps with every override handed to one Hydra compose."""
    composer.check_override_shapes(overrides)
    overrides, sp = composer._take_recipe_file(list(overrides), composer.DEFAULT_PATH)
    composer._check_group_choices(overrides, sp)
    return composer._hydra_compose(overrides, sp, composer.catalog(sp))


def composition(compose_fn, overrides: list[str]) -> tuple:
    from omegaconf import OmegaConf

    try:
        return "composed", OmegaConf.to_container(compose_fn(overrides), resolve=False)
    except USER_ERRORS as exc:
        return "refused", str(exc)
