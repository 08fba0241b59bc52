"""Launch-time checks: W&B credentials, memmap token files, cluster.setup syntax; refused before anything is written."""

from __future__ import annotations

from array import array
from pathlib import Path

import pytest

from tests.helpers import cli_in_process
from trainctl.config.data_check import SAMPLE_BYTES, data_file_problems, sampled_max_token
from trainctl.config.schema import ClusterConfig, DataConfig, WandbConfig
from trainctl.config.slurm import SlurmClusterConfig
from trainctl.launch.preflight import wandb_problems

ONLINE = WandbConfig(mode="online")


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty home directory and no W&B variables: no credentials anywhere."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "WANDB_CONFIG_DIR", "WANDB_MODE",
                 "NETRC"):
        monkeypatch.delenv(name, raising=False)
    return home


def wandb_lines(home: Path, cluster: ClusterConfig = ClusterConfig(), mode: str = "online") -> list[str]:
    return wandb_problems(WandbConfig(mode=mode), cluster, workdir=home)


# ---------------------------------------------------------------- W&B credentials


def test_online_without_credentials_is_one_line_saying_how_to_fix(home):
    (line,) = wandb_lines(home)
    assert line.startswith("logging.wandb.mode=online: no W&B API key for api.wandb.ai")
    assert "WANDB_API_KEY" in line and "wandb login" in line and "logging.wandb.mode=offline" in line


@pytest.mark.parametrize("mode", ["offline", "disabled"])
def test_other_modes_need_nothing(home, mode):
    assert wandb_lines(home, mode=mode) == []


def test_an_api_key_in_the_environment_is_enough(home, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_lines(home) == []


def test_wandb_login_netrc_entry_is_enough(home):
    (home / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    assert wandb_lines(home) == []


def test_a_netrc_entry_for_another_host_is_not(home):
    (home / ".netrc").write_text("machine github.com login u password p\n")
    (line,) = wandb_lines(home)
    assert "has no password for machine api.wandb.ai" in line


def test_a_private_server_is_looked_up_by_its_own_host(home, monkeypatch):
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
    (home / ".netrc").write_text("machine api.wandb.ai login u password p\n")
    assert "wandb.example.org" in wandb_lines(home)[0]
    (home / ".netrc").write_text("machine wandb.example.org login u password p\n")
    assert wandb_lines(home) == []


def test_the_netrc_variable_and_the_settings_file_are_honoured(home, monkeypatch, tmp_path):
    other = tmp_path / "netrc"
    other.write_text("machine api.wandb.ai login u password p\n")
    monkeypatch.setenv("NETRC", str(other))
    assert wandb_lines(home) == []
    monkeypatch.delenv("NETRC")
    (home / ".config" / "wandb").mkdir(parents=True)
    (home / ".config" / "wandb" / "settings").write_text("[default]\napi_key = " + "k" * 40 + "\n")
    assert wandb_lines(home) == []


def test_a_broken_netrc_is_named(home):
    (home / ".netrc").write_text("machine\n")
    (line,) = wandb_lines(home)
    assert str(home / ".netrc") in line and "cannot be read" in line


def test_slurm_jobs_get_cluster_env_but_local_runs_do_not(home):
    env = {"WANDB_API_KEY": "k" * 40}
    assert wandb_lines(home, SlurmClusterConfig(env=env)) == []
    assert len(wandb_lines(home, ClusterConfig())) == 1  # a local run has no cluster.env: the shell's own


def test_wandb_mode_in_the_environment_does_not_excuse_it(home, monkeypatch):
    # The worker passes mode= to wandb.init, which beats WANDB_MODE: the run would still go online.
    monkeypatch.setenv("WANDB_MODE", "offline")
    (line,) = wandb_lines(home)
    assert "WANDB_MODE=offline does not override logging.wandb.mode" in line


# ---------------------------------------------------------------- token files


def write_tokens(path: Path, ids, typecode: str = "H") -> Path:
    with open(path, "wb") as f:
        array(typecode, ids).tofile(f)
    return path


def memmap(train: Path | str, val: Path | str, dtype: str = "uint16") -> DataConfig:
    return DataConfig(kind="memmap", train_path=str(train), val_path=str(val), token_dtype=dtype, vocab_size=0)


def test_good_files_pass(tmp_path):
    ok = write_tokens(tmp_path / "ok.bin", list(range(256)) * 10)
    assert data_file_problems(memmap(ok, ok), 256, 64) == []


def test_each_bad_file_is_one_line_naming_key_and_path(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00" * 100 + b"\x01")
    (tmp_path / "empty.bin").write_bytes(b"")
    write_tokens(tmp_path / "short.bin", [1, 2, 3])
    write_tokens(tmp_path / "vocab.bin", [1, 2, 300] * 100)
    cases = {
        "missing.bin": "file not found",
        "odd.bin": "201 bytes is not a whole number of 2-byte tokens",
        "empty.bin": "file is empty",
        "short.bin": "3 tokens, fewer than train.seq_len+1=65",
        "vocab.bin": "holds token id 300, not below the vocabulary size 256",
        ".": "not a regular file",
    }
    for name, why in cases.items():
        path = tmp_path / name
        (train_line, val_line) = data_file_problems(memmap(path, path), 256, 64)
        assert train_line.startswith(f"data.train_path={str(path)!r}: ") and why in train_line, train_line
        assert val_line.startswith(f"data.val_path={str(path)!r}: ") and why in val_line


def test_a_wrong_dtype_shows_as_huge_ids(tmp_path):
    ok = write_tokens(tmp_path / "ok.bin", [1, 2, 3, 4] * 100)
    assert "check data.token_dtype=uint32" in data_file_problems(memmap(ok, ok, "uint32"), 256, 64)[0]


def test_relative_paths_are_read_from_the_workdir(tmp_path):
    write_tokens(tmp_path / "ok.bin", [1] * 100)
    assert data_file_problems(memmap("ok.bin", "ok.bin"), 256, 64, workdir=tmp_path) == []
    assert len(data_file_problems(memmap("ok.bin", "ok.bin"), 256, 64, workdir=tmp_path / "elsewhere")) == 2


def test_other_data_kinds_have_no_files_to_check(tmp_path):
    assert data_file_problems(DataConfig(), 256, 64) == []
    assert data_file_problems(DataConfig(kind="synthetic", train_path="/nope"), 256, 64) == []


@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_the_sample_reads_start_middle_and_end_of_a_big_file(tmp_path, where):
    n = 3 * SAMPLE_BYTES  # 1.5 M uint16 tokens: larger than the three windows together
    ids = array("H", bytes(2 * n))
    at = {"start": 5, "middle": n // 2, "end": n - 3}[where]
    ids[at] = 999
    path = tmp_path / "big.bin"
    with open(path, "wb") as f:
        ids.tofile(f)
    st = path.stat()
    assert sampled_max_token(str(path), "uint16", st.st_size, st.st_mtime_ns) == 999


def test_the_sample_is_bounded(tmp_path, monkeypatch):
    """An id outside the three windows is not read (the worker checks every batch); the file is not read whole."""
    n = 8 * SAMPLE_BYTES
    ids = array("H", bytes(2 * n))
    ids[n // 4] = 999
    path = tmp_path / "big.bin"
    with open(path, "wb") as f:
        ids.tofile(f)
    st = path.stat()
    assert sampled_max_token(str(path), "uint16", st.st_size, st.st_mtime_ns) == 0


# ---------------------------------------------------------------- through the CLI, in this process


run_cli = cli_in_process


SMALL = ["train.steps=2", "schedule.warmup_steps=0", "train.eval_every=0"]


@pytest.fixture
def workdir(tmp_path, monkeypatch, home):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


def runs_written(workdir: Path) -> list[str]:
    return sorted(p.name for p in (workdir / "runs").iterdir()) if (workdir / "runs").exists() else []


def test_launch_refuses_bad_token_files_before_writing_anything(workdir, monkeypatch, capsys):
    write_tokens(workdir / "big.bin", [1, 2, 300] * 100)
    code, _, err = run_cli(monkeypatch, capsys, "launch", "data=memmap", "train.seq_len=64", *SMALL,
                           "data.train_path=missing.bin", "data.val_path=big.bin")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 2 and "Traceback" not in err
    assert "data.train_path='missing.bin': file not found" in lines[0] and "data.val_path='big.bin'" in lines[1]
    assert runs_written(workdir) == []


def test_launch_refuses_online_wandb_without_credentials(workdir, monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "launch", *SMALL, "logging.wandb.mode=online")
    assert code == 2 and "logging.wandb.mode=online: no W&B API key" in err and len(err.strip().splitlines()) == 1
    assert runs_written(workdir) == []


def test_a_dry_run_refuses_what_a_start_would_refuse(workdir, monkeypatch, capsys):
    # A dry run writes what a launch would start: it is checked the same, so it leaves nothing to fail later.
    code, _, err = run_cli(monkeypatch, capsys, "launch", "data=memmap", *SMALL, "data.train_path=/nope/train.bin",
                           "data.val_path=/nope/val.bin", "logging.wandb.mode=online", "--dry-run")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 3 and "Traceback" not in err, err
    assert "file not found" in lines[1] and "no W&B API key" in lines[0]
    assert runs_written(workdir) == []


def test_plan_warns_about_token_files(workdir, monkeypatch, capsys):
    code, out, _ = run_cli(monkeypatch, capsys, "plan", "data=memmap", "train.seq_len=64",
                           "data.train_path=/nope/t.bin", "data.val_path=/nope/v.bin", "--json")
    assert code == 0 and "data.train_path='/nope/t.bin': file not found" in out


@pytest.mark.cli
def test_a_setup_that_breaks_the_script_writes_nothing_even_for_a_dry_run(workdir, monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "launch", "cluster=slurm", "cluster.procs_per_node=1", *SMALL,
                           "cluster.setup=['if true; then']", "--dry-run")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "cluster.setup" in err and "bash -n" in err
    assert runs_written(workdir) == []


@pytest.mark.parametrize(
    "override",
    ["optim.lr=inf", "cluster.procs_per_node=0", "cluster.nodes=0", "+recipe@_global_=../../../../etc/x", "name=a${b}"],
)
def test_bad_config_is_one_line_and_nothing_written(workdir, monkeypatch, capsys, override):
    code, _, err = run_cli(monkeypatch, capsys, "launch", *SMALL, override, "--dry-run")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert runs_written(workdir) == []
