"""What a launch checks before it writes a run directory or submits: what only this machine can tell.

Validation (`config.validate`) judges the config alone. These checks look at the world the
workers will meet: the sbatch script's shell syntax with the user's `cluster.setup`, W&B
credentials for `logging.wandb.mode=online`, the token files of `data.kind=memmap`, and for a
local launch the GPUs of this machine.
Each problem is one line; the CLI raises them as a user error (exit 2) before `rundir.create`.
Nothing here imports torch or wandb.
"""

from __future__ import annotations

import configparser
import netrc
import os
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

from trainctl.config.data_check import data_file_problems
from trainctl.config.hf_data_check import hf_dataset_problems
from trainctl.config.schema import ClusterConfig, RunConfig, WandbConfig
from trainctl.launch import backends
from trainctl.plan.fit import Machine

DEFAULT_WANDB_HOST = "https://api.wandb.ai"


def launch_problems(cfg: RunConfig, *, dry_run: bool = False, workdir: Path | None = None,
                    machine: Machine | None = None) -> list[str]:
    """Every problem that would stop the run after it started; [] when it may go.

    A dry run starts nothing (and may be planned away from the cluster's files), so it is
    checked only for the script it writes. `workdir` is where the workers start (relative
    data paths are read from it): the current directory at launch, the recorded one on resume.
    The backend checks its own (a local launch: the devices it names on `machine`, default this one).
    """
    problems = backends.for_cluster(cfg.cluster).preflight(cfg, dry_run=dry_run, machine=machine)
    if dry_run:
        return problems
    vocab = cfg.data.vocab_size or cfg.model.vocab_size
    problems += wandb_problems(cfg.logging.wandb, cfg.cluster, workdir=workdir)
    problems += data_file_problems(cfg.data, vocab, cfg.train.seq_len, workdir)
    problems += hf_dataset_problems(cfg.data, vocab)
    return problems


def wandb_problems(w: WandbConfig, cluster: ClusterConfig, env: Mapping[str, str] | None = None,
                   workdir: Path | None = None) -> list[str]:
    """logging.wandb.mode=online needs an API key where the workers run; found as wandb itself looks for it.

    wandb takes the key from WANDB_API_KEY (or an identity token file), a settings file, or the
    netrc entry of its host (`wandb login` writes it). On Slurm the job also gets cluster.env.
    """
    if w.mode != "online":
        return []
    job_env = dict(os.environ if env is None else env)
    job_env.update(cluster.job_env)
    if job_env.get("WANDB_API_KEY") or job_env.get("WANDB_IDENTITY_TOKEN_FILE"):
        return []
    settings = _wandb_settings(job_env, workdir or Path.cwd())
    if settings.get("api_key"):
        return []
    host = job_env.get("WANDB_BASE_URL") or settings.get("base_url") or DEFAULT_WANDB_HOST
    machine = urlsplit(host).netloc or host
    path = _netrc_path(job_env)
    found, why = _netrc_has_key(path, machine)
    if found:
        return []
    # wandb.init(mode=...) beats the environment, so WANDB_MODE does not make this run offline.
    mode_env = job_env.get("WANDB_MODE", "")
    ignored = mode_env in ("offline", "disabled")
    note = f" (WANDB_MODE={mode_env} does not override logging.wandb.mode)" if ignored else ""
    return [f"logging.wandb.mode=online: no W&B API key for {machine} ({why}){note}; set WANDB_API_KEY, "
            f"run `wandb login` (it writes the netrc entry), or use logging.wandb.mode=offline"]


def _wandb_settings(env: Mapping[str, str], workdir: Path) -> dict[str, str]:
    """The [default] section of wandb's user settings file, then the workspace's (later wins)."""
    default = Path.home() / ".config" / "wandb"
    config_dir = Path(env["WANDB_CONFIG_DIR"]).expanduser() if env.get("WANDB_CONFIG_DIR") else default
    values: dict[str, str] = {}
    for path in (config_dir / "settings", workdir / "wandb" / "settings"):
        parser = configparser.ConfigParser(interpolation=None)
        try:
            parser.read(path)
        except (configparser.Error, OSError, UnicodeDecodeError):
            continue  # wandb would not use a broken file either
        if parser.has_section("default"):
            values.update(parser["default"])
    return values


def _netrc_path(env: Mapping[str, str]) -> Path:
    if env.get("NETRC"):
        return Path(env["NETRC"]).expanduser()
    home = Path.home()
    unix = home / ".netrc"
    if not unix.exists() and (home / "_netrc").exists():
        return home / "_netrc"
    return unix


def _netrc_has_key(path: Path, machine: str) -> tuple[bool, str]:
    """Whether `path` holds a password for `machine`, else why not (for the message)."""
    try:
        entry = netrc.netrc(str(path)).authenticators(machine)
    except FileNotFoundError:
        return False, f"WANDB_API_KEY is unset and there is no {path}"
    except netrc.NetrcParseError as exc:
        return False, f"{path} cannot be read: {exc.msg} (line {exc.lineno})"
    except (OSError, UnicodeDecodeError) as exc:
        return False, f"{path} cannot be read: {getattr(exc, 'strerror', None) or exc}"
    if entry is None or not entry[2]:
        return False, f"WANDB_API_KEY is unset and {path} has no password for machine {machine}"
    return True, ""
