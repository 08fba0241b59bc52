"""Launcher backends: typed cluster config per backend, and a third backend that plugs in from this file alone.

The fake backend below is a folder the registry finds (launch/backends/fake/, written to a temporary directory on
the registry's package path) plus its typed config and its conf/cluster/fake.yaml; the CLI and the api then
compose `cluster=fake`, write its launch script (for real and as a dry run), start, list, show the log of and
cancel its runs, and queue tune's probes through it. Nothing outside this file knows it exists.
"""

from __future__ import annotations

import json
import sys
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
    queues_probes = True  # tune submits its probes as one sweep here

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

    def start_sweep(self, cfg, name: str, folder: Path, run_dirs: list[Path]) -> Launched:
        self.calls.append(("start_sweep", name, len(run_dirs)))
        return Launched(job_id="batch-9", message="queued")

    def sweep_label(self, job_id: str) -> str:
        return f"fake batch {job_id}"

    def probe_overrides(self, timeout_s: float) -> list[str]:
        return [f"cluster.namespace=probes-{timeout_s:.0f}s"]


# What launch/backends/fake/__init__.py holds: the backend registers itself when the registry imports its folder.
FOLDER_INIT = (f"from trainctl.launch.backends import register\nfrom {__name__} import FakeBackend\n\n"
               "register(FakeBackend())\n")


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """The fake backend as a folder on the registry's package path, its typed config registered, and a config
    folder with its option cluster/fake.yaml."""
    extra = tmp_path / "more_backends"
    (extra / "fake").mkdir(parents=True)
    (extra / "fake" / "__init__.py").write_text(FOLDER_INIT)
    monkeypatch.setattr(backends, "__path__", [*backends.__path__, str(extra)])
    register_cluster(FakeClusterConfig)
    conf = tmp_path / "conf"
    (conf / "cluster").mkdir(parents=True)
    (conf / "cluster" / "fake.yaml").write_text("launcher: fake\nnamespace: research\nprocs_per_node: 2\n")
    try:
        yield backends.named("fake"), conf  # found by the registry, not registered by this fixture
    finally:
        backends.unregister("fake")
        sys.modules.pop("trainctl.launch.backends.fake", None)
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


def test_the_registry_finds_the_fake_backends_folder(fake):
    backend, _ = fake
    assert isinstance(backend, FakeBackend) and backend in backends.every()
    assert sys.modules["trainctl.launch.backends.fake"].__file__.endswith("fake/__init__.py")


def test_a_dry_run_of_the_fake_backend_writes_its_script_and_starts_nothing(fake, tmp_path, monkeypatch, capsys):
    backend, conf = fake
    monkeypatch.chdir(tmp_path)
    code, out, err = run(monkeypatch, capsys, "launch", "--dry-run", "--config-dir", str(conf), "recipe=tiny_cpu",
                         "cluster=fake", "--name", "d1")
    run_dir = tmp_path / "runs" / "d1"
    assert code == 0, err
    assert f"fakectl apply -f {run_dir / 'launch.sh'}" in " ".join(out.split())  # its own start command
    assert (run_dir / "launch.sh").read_text().startswith("# fake manifest\n") and backend.calls == []
    code, out, _ = run(monkeypatch, capsys, "runs", "--runs-dir", "runs")
    assert code == 0 and "d1" in out and "NOT_STARTED" in out
    code, _, err = run(monkeypatch, capsys, "cancel", "d1", "--runs-dir", "runs")
    assert code == 2 and "not active (NOT_STARTED" in err and not [c for c in backend.calls if c[0] == "cancel"]


def test_tune_queues_its_probes_through_the_fake_backend(fake, tmp_path, monkeypatch):
    """A backend that queues runs gets tune's probes as one sweep, with its own overrides on each probe."""
    from trainctl.api import tuning
    from trainctl.config.sources import SearchPath

    backend, conf = fake
    monkeypatch.chdir(tmp_path)
    result = tuning.tune(["recipe=tiny_cpu", "cluster=fake", f"runs_dir={tmp_path / 'runs'}"],
                         SearchPath(user_dirs=(conf,)), top=2, probe_steps=4, probe_timeout_s=30, name="t")
    assert result.job_id == "batch-9" and result.message.startswith("submitted fake batch batch-9 (2 probes); ")
    assert "trainctl tune --collect t" in result.message and backend.calls == [("start_sweep", "tune-t", 2)]
    for probe in result.probes:
        assert probe.status == "submitted"
        assert load_run_config(Path(probe.run_dir)).cluster.namespace == "probes-30s"
