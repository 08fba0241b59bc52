"""`trainctl resume NAME [OVERRIDES]` before anything starts: the run's config checked again, overrides checked like a
launch, the keys that would make it another run refused, a finished run extended, the schedule's continuation told."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tests import helpers
from trainctl.config.compose import compose
from trainctl.config.errors import ConfigError
from trainctl.config.load import load_run_config, to_yaml
from trainctl.config.schema import ScheduleConfig
from trainctl.core import rundir as layout
from trainctl.launch import reshard, rundir
from trainctl.launch import resume as resumer
from trainctl.launch.errors import LaunchError
from trainctl.plan.schedule import continuation, lr_at

SMALL = ["recipe=tiny_cpu", "train.steps=10", "train.eval_every=5", "schedule.warmup_steps=2", "data=synthetic"]


def make_run(tmp_path: Path, *overrides: str, step: int | None = 10, finished: bool = True,
             workdir: Path | None = None) -> Path:
    """A run directory as a launch writes it, with a committed checkpoint at `step` and, if finished, its result."""
    run_dir = helpers.make_run(tmp_path / "runs", "r", overrides=[*SMALL, *overrides], workdir=workdir or tmp_path,
                               checkpoints=() if step is None else (step,))
    if finished:
        steps = load_run_config(run_dir).train.steps
        (run_dir / layout.RESULT).write_text(json.dumps({"steps": steps, "final_train_loss": 2.0}))
    return run_dir


def problems(excinfo) -> list[str]:
    return excinfo.value.problems


def test_train_steps_extends_a_finished_run_and_tells_what_the_schedule_does(tmp_path):
    run_dir = make_run(tmp_path)
    before = (run_dir / layout.RESULT).read_bytes()
    res = resumer.check(run_dir, ["train.steps=20"])
    assert res.finished and res.step == 10 and res.cfg.train.steps == 20
    assert any("re-stretched from 10 to 20 steps" in n for n in res.notes), res.notes
    assert len(res.warnings) == 1 and "jumps from" in res.warnings[0]
    resumer.apply(res, {"plan": "new"})
    assert load_run_config(run_dir).train.steps == 20
    assert not (run_dir / layout.RESULT).exists()  # the run is not finished any more
    history = {p.name.split("-", 2)[-1]: p for p in (run_dir / layout.HISTORY).iterdir()}
    assert history["result.json"].read_bytes() == before  # the earlier result is kept, not lost
    assert load_run_config(history["config.yaml"]).train.steps == 10
    assert (run_dir / layout.OVERRIDES).read_text().splitlines()[-1] == "train.steps=20"


def test_a_finished_run_without_more_steps_is_refused_with_the_way_to_extend_it(tmp_path):
    run_dir = make_run(tmp_path)
    for overrides in ([], ["train.steps=10"], ["optim.lr=1e-4"]):
        with pytest.raises(LaunchError) as info:
            resumer.check(run_dir, overrides)
        assert "already finished at step 10" in problems(info)[0] and "train.steps=N with N > 10" in problems(info)[0]


def test_steps_below_the_newest_checkpoint_are_refused(tmp_path):
    run_dir = make_run(tmp_path, "train.steps=30", step=12, finished=False)
    with pytest.raises(ConfigError) as info:
        resumer.check(run_dir, ["train.steps=11"])
    assert problems(info) == ["train.steps=11: the run's newest checkpoint is at step 12; use train.steps >= 12"]


@pytest.mark.parametrize("override, key", [
    ("model.dim=64", "model.dim"), ("train.seq_len=128", "train.seq_len"), ("train.seed=3", "train.seed"),
    ("data.kind=stdlib", "data.kind"), ("cluster.device=cuda", "cluster.device"),
    ("train.global_batch=32", "train.global_batch"),
    ("precision.compute_dtype=bf16", "precision.compute_dtype"), ("optim.name=adafactor", "optim.name"),
])
def test_keys_that_would_make_it_another_run_are_refused(tmp_path, override, key):
    run_dir = make_run(tmp_path, finished=False, step=5)
    with pytest.raises(ConfigError) as info:
        resumer.check(run_dir, [override])
    assert len(problems(info)) == 1 and f"a resume keeps {key}" in problems(info)[0]
    assert "checkpoint.resume=" in problems(info)[0]  # what to do instead


@pytest.mark.parametrize("override", ["model.lora.rank=8", "model.lora.targets=[q,v]"])
def test_a_lora_change_suggests_a_new_run_from_merged_weights_not_a_resume_that_cannot_load(tmp_path, override):
    """checkpoint.resume=RUN_DIR would load adapters of another shape (a size mismatch in the worker)."""
    run_dir = make_run(tmp_path, finished=False, step=5)
    with pytest.raises(ConfigError) as info:
        resumer.check(run_dir, [override])
    (line,) = problems(info)
    assert line.endswith(resumer.LORA_HINT) and "checkpoint.resume=" not in line
    assert "trainctl export RUN --merged --out DIR" in line and "checkpoint.init_from=DIR" in line


def test_a_new_split_of_the_same_global_batch_is_allowed_and_a_changed_kept_key_named(tmp_path):
    run_dir = make_run(tmp_path, finished=False, step=5)
    old = load_run_config(run_dir)
    ok = resumer.check(run_dir, ["train.micro_batch=-1", "train.grad_accum=2"])
    assert ok.resolved.train.global_batch == old.train.global_batch and ok.resolved.train.grad_accum == 2
    # Whatever derives a kept key anew (the safety net behind the refusal by key) is named with both values.
    changed = dataclasses.replace(old, train=dataclasses.replace(old.train, global_batch=32))
    assert resumer.frozen_changes(old, changed) == [
        "train.global_batch: 16 -> 32: a resume keeps it; " + resumer.NEW_RUN_HINT]


@pytest.mark.parametrize("procs, micro, accum", [(1, 8, 2), (4, 4, 1), (8, 2, 1), (16, 1, 1)])
def test_another_world_size_keeps_the_global_batch_and_recomputes_the_accumulation(tmp_path, procs, micro, accum):
    """tiny_cpu: ddp on 2 workers, global batch 16 = 8 micro x 1 accum x 2; the run's micro-batch is kept when it
    fits a rank's share of the batch, else the largest that divides it."""
    run_dir = make_run(tmp_path, finished=False, step=5)
    res = resumer.check(run_dir, [f"cluster.procs_per_node={procs}"])
    t, s = res.resolved.train, res.resolved.sharding
    assert (t.global_batch, t.micro_batch, t.grad_accum, s.dp_replicate, s.dp_shard) == (16, micro, accum, procs, 1)
    assert res.cfg.cluster.procs_per_node == procs and res.cfg.train.grad_accum == accum  # what config.yaml gets
    assert [n for n in res.notes if n.startswith(f"resharding from 2 to {procs} workers")], res.notes
    resumer.apply(res, {"plan": "resharded"})
    written = load_run_config(run_dir)
    assert (written.cluster.procs_per_node, written.train.grad_accum, written.sharding.dp_replicate) == (
        procs, accum, procs)


def test_the_same_layout_says_nothing_of_resharding(tmp_path):
    run_dir = make_run(tmp_path, finished=False, step=5)
    res = resumer.check(run_dir, ["cluster.procs_per_node=2", "optim.lr=1e-3"])
    assert not [n for n in res.notes if "resharding" in n] and res.resolved.train.grad_accum == 1


def test_a_world_that_cannot_split_the_global_batch_is_one_line_naming_the_keys(tmp_path):
    run_dir = make_run(tmp_path, finished=False, step=5)
    with pytest.raises(ConfigError) as info:
        resumer.check(run_dir, ["cluster.procs_per_node=3"])
    assert problems(info) == ["cluster.nodes=1 cluster.procs_per_node=3: a data-parallel degree of 3 cannot split "
                              "train.global_batch=16, which a resume keeps; use a world whose data-parallel degree "
                              "divides 16"]


@pytest.mark.parametrize("override", ["cluster.procs_per_node=0", "cluster.nodes=0", "cluster.procs_per_node=-2"])
def test_a_world_of_no_workers_is_refused_by_validation_in_one_line(tmp_path, override):
    run_dir = make_run(tmp_path, finished=False, step=5)
    with pytest.raises(ConfigError) as info:  # not a ZeroDivisionError from splitting the batch over 0 ranks
        resumer.check(run_dir, [override])
    assert problems(info) == [f"{run_dir / 'config.yaml'} with the overrides: {override.split('=')[0]}="
                              f"{override.split('=')[1]}: must be >= 1"]


def test_the_cli_refuses_a_world_that_cannot_split_the_batch_in_one_line_and_writes_nothing(tmp_path, monkeypatch,
                                                                                          capsys):
    run_dir = make_run(tmp_path, finished=False, step=5)
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    monkeypatch.chdir(tmp_path)
    code, out, err = helpers.cli_in_process(monkeypatch, capsys, "resume", "r", "cluster.procs_per_node=3")
    assert code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines() == ["error: cluster.nodes=1 cluster.procs_per_node=3: a data-parallel degree of 3 "
                                        "cannot split train.global_batch=16, which a resume keeps; use a world whose "
                                        "data-parallel degree divides 16"]
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before
    assert not (run_dir / layout.HISTORY).exists()


def test_a_new_split_with_tensor_parallelism_derives_the_data_parallel_degree(tmp_path):
    run_dir = make_run(tmp_path, finished=False, step=5)
    res = resumer.check(run_dir, ["cluster.procs_per_node=4", "sharding.tp=2"])
    s, t = res.resolved.sharding, res.resolved.train
    assert (s.tp, s.dp_replicate, t.micro_batch, t.grad_accum) == (2, 2, 8, 1)
    assert any("(ddp dp_replicate=2 -> ddp dp_replicate=2 tp=2)" in n for n in res.notes), res.notes


@pytest.mark.parametrize("schedule, micro, accum", [("1f1b", 4, 2), ("gpipe", 8, 1)])
def test_a_new_pipeline_split_gets_the_microbatches_its_schedule_needs(tmp_path, schedule, micro, accum):
    run_dir = make_run(tmp_path, f"sharding.pp_schedule={schedule}", finished=False, step=5)
    res = resumer.check(run_dir, ["cluster.procs_per_node=4", "sharding.pp=2"])
    s, t = res.resolved.sharding, res.resolved.train
    assert (s.pp, s.dp_replicate, t.micro_batch, t.grad_accum) == (2, 2, micro, accum)


def test_a_strategy_dcp_reshards_is_a_new_split_and_the_data_parallel_key_follows_it(tmp_path):
    run_dir = make_run(tmp_path, finished=False, step=5)
    res = resumer.check(run_dir, ["sharding.strategy=fsdp", "cluster.procs_per_node=1"])
    s = res.resolved.sharding
    assert (s.strategy, s.dp_replicate, s.dp_shard) == ("zero3", 1, 1) and res.resolved.train.grad_accum == 2


def test_a_given_micro_batch_or_accumulation_is_kept_and_the_other_derived(tmp_path):
    run_dir = make_run(tmp_path, finished=False, step=5)
    res = resumer.check(run_dir, ["cluster.procs_per_node=1", "train.grad_accum=4"])
    assert (res.resolved.train.micro_batch, res.resolved.train.grad_accum) == (4, 4)
    with pytest.raises(ConfigError) as info:
        resumer.check(run_dir, ["cluster.procs_per_node=1", "train.micro_batch=8", "train.grad_accum=1"])
    assert len(problems(info)) == 1 and "train.global_batch=16: must equal" in problems(info)[0]


@pytest.mark.parametrize("run, overrides", [
    (["sharding=zero1"], ["cluster.procs_per_node=1"]),  # zero1's per-rank shards on another world
    (["sharding=zero1"], ["sharding.strategy=ddp"]),  # zero1 out: the checkpoint has no DCP optimizer state
    ([], ["sharding.strategy=zero1"]),  # zero1 in: it would look for per-rank shards the checkpoint lacks
])
def test_zero1s_per_rank_optimizer_state_is_not_resharded_and_says_what_to_do(tmp_path, run, overrides):
    run_dir = make_run(tmp_path, *run, finished=False, step=5)
    with pytest.raises(ConfigError) as info:
        resumer.check(run_dir, overrides)
    assert len(problems(info)) == 1 and "zero1 optimizer state is saved per rank" in problems(info)[0]
    assert "resume on its layout (2 workers" in problems(info)[0] and "load_only=model" in problems(info)[0]
    assert reshard.layout_changed(load_run_config(run_dir), load_run_config(run_dir)) is False


def test_a_resume_from_the_start_reshards_nothing_and_says_nothing(tmp_path):
    run_dir = make_run(tmp_path, finished=False, step=None)
    res = resumer.check(run_dir, ["cluster.procs_per_node=1"])
    assert res.step is None and res.resolved.train.grad_accum == 2 and not res.notes


@pytest.mark.parametrize("override, says", [
    ("model=llama2_7b", "a resume keeps the run's model"),
    ("+train.foo=1", "existing keys only"),
    ("~optim.lr", "existing keys only"),
    ("optim.lr=1e-3,1e-4", "several values"),
    ("optim.lr=abc", "optim.lr=abc: Value 'abc'"),
    ("train.nope=1", "train.nope=1: Key 'nope' not in 'TrainConfig'"),
    ("optim.lr=-1", "optim.lr=-1.0: must be > 0"),
    ("train.steps=", "train.steps="),
])
def test_bad_overrides_are_one_line_each(tmp_path, override, says):
    run_dir = make_run(tmp_path, finished=False, step=5)
    with pytest.raises(ConfigError) as info:
        resumer.check(run_dir, [override])
    assert len(problems(info)) == 1 and says in problems(info)[0], problems(info)


@pytest.mark.parametrize("edit, says", [
    ({"model": {"n_kv_heads": 3}}, "model.n_kv_heads=3: must divide"),
    ({"train": {"steps": -5}}, "train.steps"),
    ({"optim": {"lr": "fast"}}, "optim.lr"),
])
def test_a_hand_edited_config_is_checked_again_naming_the_file(tmp_path, edit, says):
    import yaml

    run_dir = make_run(tmp_path, finished=False, step=None)
    data = yaml.safe_load((run_dir / layout.CONFIG).read_text())
    for group, values in edit.items():
        data[group].update(values)
    (run_dir / layout.CONFIG).write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        resumer.check(run_dir, [])
    assert all(line.startswith(str(run_dir / layout.CONFIG)) for line in problems(info))
    assert any(says in line for line in problems(info)), problems(info)


def test_a_moved_hugging_face_source_does_not_stop_a_resume_from_a_checkpoint(tmp_path):
    run_dir = make_run(tmp_path, finished=False, step=None)
    cfg = load_run_config(run_dir)
    gone = tmp_path / "gone-hf"
    moved = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name="hf", path=str(gone)),
                                checkpoint=dataclasses.replace(cfg.checkpoint, init_from=str(gone)))
    (run_dir / layout.CONFIG).write_text(to_yaml(moved))
    with pytest.raises(ConfigError) as info:  # no checkpoint yet: the worker would read the folder
        resumer.check(run_dir, [])
    assert f"model.path={gone}" in problems(info)[0]
    ckpt = run_dir / "checkpoints" / "step-00000004"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text("{}")
    res = resumer.check(run_dir, ["train.steps=12"])  # from its own checkpoint it never reads the folder again
    assert res.cfg.model.path == str(gone) and res.cfg.checkpoint.init_from == str(gone)


def test_the_working_directory_is_read_by_structure_never_by_substring(tmp_path):
    workdir = tmp_path / "my RUN_DIR data"  # the text RUN_DIR in the path once made resume skip it
    workdir.mkdir()
    run_dir = make_run(tmp_path, finished=False, step=None, workdir=workdir)
    assert rundir.script_workdir(run_dir) == workdir
    plan = json.loads((run_dir / layout.PLAN).read_text())
    del plan[rundir.WORKDIR_KEY]  # a run written before plan.json recorded it: read from the script's `cd` line
    (run_dir / layout.PLAN).write_text(json.dumps(plan))
    assert rundir.script_workdir(run_dir) == workdir


WSD = ScheduleConfig(name="wsd", warmup_steps=10, decay_fraction=0.2, min_lr_ratio=0.1)
COSINE = ScheduleConfig(name="cosine", warmup_steps=10, min_lr_ratio=0.1)


def test_continuation_of_a_wsd_run_in_its_stable_phase_does_not_jump():
    note, jump = continuation(50, (1e-3, WSD, 100), (1e-3, WSD, 200))
    assert jump is None and "stable at 0.001 until step 160" in note


def test_continuation_after_a_wsd_decay_warns_of_the_jump_back_to_the_peak():
    note, jump = continuation(100, (1e-3, WSD, 100), (1e-3, WSD, 200))
    assert jump is not None and "jumps from 0.0001" in jump and "to 0.001 " in jump and "wsd decay" in jump


def test_continuation_of_a_stretched_cosine_warns_with_the_rates():
    note, jump = continuation(100, (1e-3, COSINE, 100), (1e-3, COSINE, 200))
    last, nxt = lr_at(99, 1e-3, COSINE, 100), lr_at(100, 1e-3, COSINE, 200)
    assert f"{last:.3g}" in jump and f"{nxt:.3g}" in jump and "re-stretched" in note


def test_an_unchanged_schedule_continues_without_a_warning():
    assert continuation(37, (1e-3, COSINE, 100), (1e-3, COSINE, 100))[1] is None


def test_an_override_nested_too_deeply_for_the_parser_is_one_line():
    """Hydra's override grammar recurses per nesting level: a RecursionError, not a HydraException, comes out."""
    deep = "train.steps=" + "[" * 3000 + "1" + "]" * 3000
    with pytest.raises(ConfigError) as exc:
        resumer.apply_overrides(compose(["recipe=tiny_cpu"]), [deep])
    assert exc.value.problems == ["an override nests too deeply to parse; a resume takes key=value overrides, "
                                  "e.g. train.steps=2000"]


def _record(run_dir: Path, step: int, model) -> None:
    """The model record a worker's checkpoint keeps in its meta.json (core/model_record.py)."""
    from trainctl.core import model_record

    meta = run_dir / "checkpoints" / f"step-{step:08d}" / "meta.json"
    meta.write_text(json.dumps({"step": step, "model": model_record.record(model)}))


def test_a_resume_under_a_config_edited_since_the_checkpoint_is_refused_naming_the_key(tmp_path):
    run_dir = make_run(tmp_path, finished=False, step=5)
    _record(run_dir, 5, load_run_config(run_dir).model)
    resumer.check(run_dir, [])
    config = run_dir / layout.CONFIG
    config.write_text(config.read_text().replace("rope_theta: 10000.0", "rope_theta: 500000.0"))
    with pytest.raises(ConfigError) as err:
        resumer.check(run_dir, [])
    (line,) = problems(err)
    assert "step-00000005" in line and "model.rope_theta=500000.0 (saved: 10000.0)" in line, line


def test_a_launch_from_another_runs_checkpoint_checks_its_model_record(tmp_path):
    from trainctl.config.validate import resolve
    from trainctl.launch.start_point import source_problems

    source = make_run(tmp_path / "a", "model.lora.rank=4", finished=False, step=5)
    _record(source, 5, load_run_config(source).model)
    base = [*SMALL, f"checkpoint.resume={source}"]
    (line,) = source_problems(resolve(compose([*base, "checkpoint.load_only=model"])))
    assert "LoRA adapters (rank 4" in line and "--merged" in line and "checkpoint.init_from" in line, line
    assert source_problems(resolve(compose([*base, "checkpoint.load_only=model", "model.lora.rank=4"]))) == []
    (line,) = source_problems(resolve(compose([*base, "model.lora.rank=4", "model.lora.alpha=8"])))
    assert "model.lora={rank: 4, alpha: 8.0" in line, line  # load_only=all: a continuation of that very model
