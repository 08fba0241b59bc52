"""Resume on another world size (issue 26): `trainctl resume NAME cluster.procs_per_node=M` continues a run stopped
on 2 workers as if it had never stopped: DCP reshards the model and optimizer, the data continues at the same
global sample, the grad accumulation keeps the global batch. fp32, gloo on CPU."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from worker_runs import TINY_OVERRIDES

from tests.faults.worker_faults import fault_env
from tests.helpers import curve_rel, run_cli
from trainctl.config.load import load_run_config

pytestmark = pytest.mark.dist

STEPS, STOP_AT = 20, 10
# Global batch 8 = 4 micro x 1 accum x 2 workers; on 1 worker 4 x 2 x 1, on 4 workers 2 x 1 x 4.
SMALL = [*TINY_OVERRIDES, "recipe=tiny_cpu", f"train.steps={STEPS}", "train.eval_every=0", "logging.log_every=1",
         "train.global_batch=8", "train.micro_batch=4", "train.grad_accum=-1", "cluster.procs_per_node=2"]


def trainctl(cwd: Path, *args: str, **env) -> subprocess.CompletedProcess:
    proc = run_cli(*args, cwd=cwd, timeout=300, **env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def losses(run_dir: Path) -> dict[int, float]:
    """Loss per step; a resumed attempt's records replace the earlier attempt's for the same steps."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r.get("kind") == "train"}


def consumed(probe: Path) -> dict[int, list[int]]:
    """Step -> the global sample ids it read: the data-parallel ranks' ids in rank order (tp peers read alike)."""
    by_step: dict[int, dict[int, list[int]]] = {}
    for path in probe.glob("samples-rank*.jsonl"):
        for r in map(json.loads, path.read_text().splitlines()):
            by_step.setdefault(r["step"], {})[r["dp_rank"]] = r["ids"]  # a later attempt's record wins
    return {step: [j for _, ids in sorted(ranks.items()) for j in ids] for step, ranks in by_step.items()}


def straight_and_stopped(root: Path, cache: str, *extra: str) -> tuple[Path, Path]:
    """One run of STEPS on 2 workers, and one stopped after STOP_AT (a checkpoint there); each probed."""
    for name, faults in (("straight", {}), ("stopped", {"stop_after_step": STOP_AT})):
        probe = root / f"{name}-samples"
        probe.mkdir()
        trainctl(root, "launch", *SMALL, *extra, cache, "--name", name,
                 **fault_env(sample_probe=str(probe), **faults))
    stopped = root / "runs" / "stopped"
    assert not (stopped / "result.json").exists() and max(losses(stopped)) == STOP_AT
    return root / "runs" / "straight", stopped


def resume_on(root: Path, name: str, procs: int, *extra: str) -> Path:
    probe = root / f"{name}-samples"
    proc = trainctl(root, "resume", name, f"cluster.procs_per_node={procs}", *extra,
                    **fault_env(sample_probe=str(probe)))
    assert f"resharding from 2 to {procs} workers" in proc.stdout, proc.stdout[-2000:]
    run_dir = root / "runs" / name
    assert load_run_config(run_dir).cluster.procs_per_node == procs
    assert json.loads((run_dir / "result.json").read_text())["resumed_from_step"] == STOP_AT
    return run_dir


def assert_continues(resumed: Path, straight: Path, root: Path) -> None:
    got, want = losses(resumed), losses(straight)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step in got:  # resharding changes the order of fp32 sums: rounding, not bitwise
        assert got[step] == pytest.approx(want[step], rel=curve_rel(step)), (step, got[step], want[step])
    ids, reference = consumed(root / f"{resumed.name}-samples"), consumed(root / "straight-samples")
    assert sorted(ids) == list(range(1, STEPS + 1))
    assert ids == reference  # every step read the same global samples, in the same order
    assert reference[STEPS] == list(range((STEPS - 1) * 8, STEPS * 8))  # the stream by global sample


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory, data_cache):
    root = tmp_path_factory.mktemp("world")
    straight, stopped = straight_and_stopped(root, f"data.cache_dir={data_cache}")
    return root, straight, stopped


def test_a_ddp_run_stopped_on_2_workers_resumes_on_1_as_if_it_never_stopped(ddp_runs):
    root, straight, stopped = ddp_runs
    copy = root / "runs" / "to-one"
    shutil.copytree(stopped, copy)
    shutil.copytree(root / "stopped-samples", root / "to-one-samples")
    resumed = resume_on(root, "to-one", 1)
    assert load_run_config(resumed).train.grad_accum == 2  # 4 micro x 2 accum x 1 worker: the same global batch
    assert "resharded" in (resumed / "logs" / "rank0.log").read_text()
    assert_continues(resumed, straight, root)


@pytest.mark.parametrize("split, dp, micro", [((), 4, 2), (("sharding.tp=2",), 2, 4)], ids=["dp4", "dp2_tp2"])
def test_a_ddp_run_stopped_on_2_workers_resumes_on_4(ddp_runs, split, dp, micro):
    """4 workers: ddp x 4 (2 micro x 1 accum x 4), or ddp x 2 with tensor parallelism of 2 (4 x 1 x 2)."""
    root, straight, stopped = ddp_runs
    name = f"to-four-dp{dp}"
    shutil.copytree(stopped, root / "runs" / name)
    shutil.copytree(root / "stopped-samples", root / f"{name}-samples")
    resumed = resume_on(root, name, 4, *split)
    cfg = load_run_config(resumed)
    assert (cfg.sharding.dp_replicate, cfg.train.micro_batch, cfg.train.grad_accum) == (dp, micro, 1)
    assert_continues(resumed, straight, root)


def test_a_zero3_run_stopped_on_2_workers_resumes_on_1(tmp_path, data_cache):
    straight, stopped = straight_and_stopped(tmp_path, f"data.cache_dir={data_cache}", "sharding=zero3")
    resumed = resume_on(tmp_path, "stopped", 1)
    assert load_run_config(resumed).sharding.dp_shard == 1
    assert_continues(resumed, straight, tmp_path)
