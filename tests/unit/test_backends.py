"""Launcher backends: typed cluster config per backend, and a third backend that plugs in from this file alone.

The fake backend below registers its typed config and its Backend; the CLI then composes `cluster=fake`,
writes its launch script, starts, lists, shows the log of and cancels its runs through it. Nothing
outside this file knows it exists.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from tests.helpers import cli_in_process
from trainctl.config import schema
from trainctl.config.compose import compose
from trainctl.config.errors import ConfigError
from trainctl.config.load import load_run_config, to_yaml
from trainctl.config.schema import ClusterConfig, register_cluster
from trainctl.config.slurm import SlurmClusterConfig
from trainctl.config.validate import resolve
from trainctl.core import rundir
from trainctl.launch import backends
from trainctl.launch.backends.base import Backend, Launched

# ---------------------------------------------------------------- typed cluster config per backend


def test_each_cluster_option_composes_into_its_backends_class():
    assert type(compose(["cluster=local"]).cluster) is ClusterConfig
    slurm = compose(["cluster=slurm", "cluster.partition=gpu", "cluster.container.exec=apptainer exec x.sif"])
    assert type(slurm.cluster) is SlurmClusterConfig
    assert (slurm.cluster.partition, slurm.cluster.container.exec) == ("gpu", "apptainer exec x.sif")


def test_a_key_of_another_backend_is_one_line_naming_the_backend_that_has_it():
    with pytest.raises(ConfigError) as err:
        compose(["recipe=tiny_cpu", "cluster.partition=gpu"])
    assert err.value.problems == ["cluster.partition='gpu': cluster=local has no such key (a key of cluster=slurm); "
                                  "choose cluster=slurm, or drop it"]


def test_a_key_no_backend_has_is_still_an_unknown_key():
    with pytest.raises(ConfigError) as err:
        compose(["cluster.partitionn=gpu"])
    (line,) = err.value.problems
    assert line.startswith("cluster.partitionn: unknown key")


def test_a_wrong_type_in_a_backend_key_names_the_key():
    with pytest.raises(ConfigError) as err:
        compose(["cluster=slurm", "cluster.preemption.lead_s=soon"])
    (line,) = err.value.problems
    assert line.startswith("cluster.preemption.lead_s:")


def test_a_run_directory_written_before_the_split_still_loads(tmp_path):
    """Old local runs saved every cluster key (Slurm's too, mostly defaults): they load, the foreign keys dropped."""
    text = to_yaml(compose(["recipe=tiny_cpu"])).replace(
        "  cpu_threads: 0\n", "  cpu_threads: 0\n  partition: ''\n  time_limit: 02:00:00\n  setup: []\n  env: {}\n")
    assert "time_limit: 02:00:00" in text
    (tmp_path / "config.yaml").write_text(text)
    assert type(load_run_config(tmp_path).cluster) is ClusterConfig


def test_a_config_class_must_match_its_launcher():
    with pytest.raises(ValueError, match="cluster=local, not launcher='slurm'"):
        ClusterConfig(launcher="slurm")


# ---------------------------------------------------------------- a third backend, from this file alone


@dataclass(frozen=True)
class FakeClusterConfig(ClusterConfig):
    """A scheduler-like backend that runs nowhere: what a Kubernetes backend would add, minus the cluster."""

    NAME: ClassVar[str] = "fake"
    on_this_machine: ClassVar[bool] = False
    multi_node: ClassVar[bool] = True

    launcher: str = "fake"
    namespace: str = "default"

    def problems(self) -> list[str]:
        return [] if self.namespace else ["cluster.namespace: empty; name the namespace the pods run in"]


class FakeBackend(Backend):
    name = "fake"

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def render(self, cfg, run_dir: Path, workdir: Path) -> str:
        return f"# fake manifest\nnamespace: {cfg.cluster.namespace}\nrun_dir: {run_dir}\n"

    def argv(self, cluster, run_dir: Path) -> list[str]:
        return ["fakectl", "apply", f"--namespace={cluster.namespace}", str(run_dir)]

    def start_command(self, script: Path) -> list[str]:
        return ["fakectl", "apply", "-f", str(script)]

    def submit_problems(self, cfg) -> list[str]:
        return []

    def start(self, run_dir: Path, cfg, *, new: bool, held=None, out=None) -> Launched:
        self.calls.append(("start", run_dir.name, new))
        rundir.write_json_atomic(run_dir / rundir.LAUNCH, {"launcher": "fake", "job_id": "pod-7"})
        return Launched(job_id="pod-7", message=f"queued pod-7 in {cfg.cluster.namespace}")

    def states(self, records: dict[Path, dict]):
        self.calls.append(("states", sorted(d.name for d in records)))
        return {d: ("RUNNING", True, f"pod {r.get('job_id')}") for d, r in records.items()}

    def log_path(self, run_dir: Path, record: dict) -> Path:
        return run_dir / "logs" / f"{record.get('job_id')}.log"

    def job_label(self, job_id: str) -> str:
        return f"fake pod {job_id}"

    def cancel(self, run_dir: Path, job_id: str) -> None:
        self.calls.append(("cancel", run_dir.name, job_id))


@pytest.fixture
def fake(tmp_path):
    """The fake backend registered, and a config folder with its option cluster/fake.yaml."""
    register_cluster(FakeClusterConfig)
    backend = backends.register(FakeBackend())
    conf = tmp_path / "conf"
    (conf / "cluster").mkdir(parents=True)
    (conf / "cluster" / "fake.yaml").write_text("launcher: fake\nnamespace: research\nprocs_per_node: 2\n")
    try:
        yield backend, conf
    finally:
        backends.unregister("fake")
        schema.unregister_cluster("fake")


run = cli_in_process


def test_a_fake_backend_plugs_in_without_touching_other_files(fake, tmp_path, monkeypatch, capsys):
    backend, conf = fake
    monkeypatch.chdir(tmp_path)
    launch = ["launch", "--config-dir", str(conf), "recipe=tiny_cpu", "cluster=fake", "--name", "f1"]
    code, out, err = run(monkeypatch, capsys, *launch)
    assert code == 0, err
    run_dir = tmp_path / "runs" / "f1"
    assert "queued pod-7 in research" in out and backend.calls == [("start", "f1", True)]
    # Its own typed config, script and command, saved in the run directory and read back.
    assert (run_dir / "launch.sh").read_text().startswith("# fake manifest\nnamespace: research\n")
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["launch_argv"] == ["fakectl", "apply", "--namespace=research", str(run_dir)]
    assert load_run_config(run_dir).cluster == FakeClusterConfig(procs_per_node=2, namespace="research")
    # Watching and stopping go through it too.
    code, out, _ = run(monkeypatch, capsys, "runs", "--runs-dir", "runs")
    assert code == 0 and "f1" in out and "RUNNING" in out and ("states", ["f1"]) in backend.calls
    (run_dir / "logs" / "pod-7.log").write_text("hello from the pod\n")
    code, out, _ = run(monkeypatch, capsys, "logs", "f1", "--runs-dir", "runs")
    assert code == 0 and "hello from the pod" in out
    code, out, _ = run(monkeypatch, capsys, "cancel", "f1", "--runs-dir", "runs")
    assert code == 0 and "cancelled fake pod pod-7 of run f1" in out and ("cancel", "f1", "pod-7") in backend.calls


def test_a_fake_backend_validates_its_own_keys(fake):
    _, conf = fake
    from trainctl.config.sources import SearchPath

    cfg = compose(["recipe=tiny_cpu", "cluster=fake", "cluster.namespace="], SearchPath(user_dirs=(conf,)))
    with pytest.raises(ConfigError) as err:
        resolve(cfg)
    assert "cluster.namespace: empty; name the namespace the pods run in" in err.value.problems
    with pytest.raises(ConfigError) as err:
        compose(["recipe=tiny_cpu", "cluster=fake", "cluster.partition=gpu"], SearchPath(user_dirs=(conf,)))
    assert err.value.problems[0].startswith("cluster.partition='gpu': cluster=fake has no such key")
