"""`trainctl tune` repeats each probe (--repeats, default 2), shows the spread and says when its ranking is within
that noise; a start whose layout does not suit the cluster gets what tune derives instead of a refusal."""

from __future__ import annotations

import pytest
from test_tune_probes import FakeHandle, FakePrepared, write_metrics

from trainctl.api import launching, tuning, watching
from trainctl.config.compose import compose
from trainctl.core.errors import UserError
from trainctl.plan import tune as planner


def fake_launches(tmp_path, monkeypatch, speeds: dict[str, float]) -> list[str]:
    """Every probe run ends well at the speed `speeds` gives its run name (default 100); the names launched."""
    names = []

    def prepare(overrides, config_dirs=None, *, name="", **_):
        names.append(name)
        run_dir = tmp_path / "runs" / "tune" / "t" / name
        run_dir.mkdir(parents=True)
        write_metrics(run_dir, [1.0] + [speeds.get(name, 100.0)] * 4, 1000 + len(names))
        return FakePrepared(run_dir)

    monkeypatch.setattr(launching, "prepare_launch", prepare)
    monkeypatch.setattr(launching, "start", lambda prepared, **_: FakeHandle(0))
    monkeypatch.setattr(watching, "cancel", lambda run_dir: None)
    monkeypatch.chdir(tmp_path)
    return names


def test_each_probe_runs_twice_by_default_and_the_table_shows_its_spread(tmp_path, monkeypatch):
    speeds = {"probe-01": 300.0, "probe-01-r2": 340.0, "probe-02": 200.0, "probe-02-r2": 210.0}
    names = fake_launches(tmp_path, monkeypatch, speeds)
    result = tuning.tune(["recipe=tiny_cpu"], top=2, probe_steps=8, name="t")
    assert names == ["probe-01", "probe-01-r2", "probe-02", "probe-02-r2"]
    first, second = result.probes
    assert first.repeats == [300.0, 340.0] and first.measured_tokens_per_s == 320.0  # the median
    assert first.spread == pytest.approx(40.0 / 320.0) and second.spread == pytest.approx(10.0 / 205.0)
    assert first.measured_peak_bytes == 1002  # the larger of its two runs' peaks
    assert result.to_dict()["rows"][0]["spread"] == first.spread and result.repeats == 2
    assert result.noise == ""  # 300-340 against 200-210: a measured difference


def test_a_ranking_within_the_repeats_noise_says_so(tmp_path, monkeypatch):
    speeds = {"probe-01": 300.0, "probe-01-r2": 200.0, "probe-02": 210.0, "probe-02-r2": 240.0}
    fake_launches(tmp_path, monkeypatch, speeds)
    result = tuning.tune(["recipe=tiny_cpu"], top=2, probe_steps=8, name="t")
    assert [p.measured_tokens_per_s for p in result.probes] == [250.0, 225.0]
    assert result.noise.startswith("within noise: ") and "(200-300 tokens/s)" in result.noise
    assert "(210-240) overlap across repeats" in result.noise


def test_bad_repeats_are_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for bad in (0, -1, True):
        with pytest.raises(UserError, match="repeats"):
            tuning.tune(["recipe=tiny_cpu"], repeats=bad)


def test_a_start_that_does_not_suit_the_world_gets_what_tune_derives(tmp_path, monkeypatch):
    fake_launches(tmp_path, monkeypatch, {})
    # 4 workers: tiny_cpu's micro_batch 8 does not divide 16 sequences over 4 ranks
    result = tuning.tune(["recipe=tiny_cpu", "cluster.procs_per_node=4"], top=1, probe_steps=8, name="t", repeats=1)
    assert result.filled == ["train.micro_batch=4"]
    assert result.base_overrides == ["recipe=tiny_cpu", "cluster.procs_per_node=4", "train.micro_batch=4"]


@pytest.mark.parametrize(("overrides", "fills"), [
    (["sharding=fsdp", "sharding.dp_shard=2", "cluster.procs_per_node=4"],
     ["sharding.dp_shard=4", "train.micro_batch=4"]),
    (["sharding.tp=3", "cluster.procs_per_node=4"], ["sharding.tp=1", "train.micro_batch=4"]),
    (["train.grad_accum=1", "train.micro_batch=2", "cluster.procs_per_node=4"], ["train.grad_accum=-1"]),
    (["cluster.procs_per_node=2"], []),  # tiny_cpu as it is: nothing to fill
    (["train.global_batch=6", "cluster.procs_per_node=4"], []),  # the global batch is the user's: left to refuse
])
def test_start_fills_derive_degrees_micro_batch_and_accumulation_only(overrides, fills):
    assert planner.start_fills(compose(["recipe=tiny_cpu", *overrides])) == fills


def test_a_global_batch_the_ranks_do_not_divide_is_still_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="train.global_batch=6"):
        tuning.tune(["recipe=tiny_cpu", "train.global_batch=6", "cluster.procs_per_node=4"])
