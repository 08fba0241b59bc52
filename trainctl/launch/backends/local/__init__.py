"""The local backend (`cluster=local`): torchrun on this machine, started and watched by this process.

Its script and run (launcher.py), progress bar (progress.py), failure reading (failure.py) and the state of its
runs and their stopping (state.py) are all in this folder; its typed config is config.schema.ClusterConfig.
"""

from __future__ import annotations

import sys
from pathlib import Path

from trainctl.config.schema import ClusterConfig, RunConfig
from trainctl.launch.backends import register
from trainctl.launch.backends.base import Backend, Launched, StateTuple
from trainctl.launch.backends.local import launcher as local
from trainctl.launch.backends.local import state
from trainctl.plan.fit import local_device_problems, this_machine


class LocalBackend(Backend):
    name = "local"

    def preflight(self, cfg: RunConfig, *, dry_run: bool, machine=None) -> list[str]:
        # A dry run may be written here and started elsewhere: this machine's devices are not its business.
        return [] if dry_run else local_device_problems(cfg.cluster, machine or this_machine())

    def render(self, cfg: RunConfig, run_dir: Path, workdir: Path) -> str:
        return local.render_script(cfg.cluster, run_dir, workdir)

    def argv(self, cluster: ClusterConfig, run_dir: Path) -> list[str]:
        return local.local_argv(cluster, run_dir, sys.executable)

    def start_command(self, script: Path) -> list[str]:
        return ["bash", str(script)]

    def lock_before_start(self, run_dir: Path):
        return local.lock(run_dir)

    def start(self, run_dir: Path, cfg: RunConfig, *, new: bool, held=None, out=None) -> Launched:
        steps = cfg.train.steps if cfg.logging.progress else 0
        if out is None:
            return Launched(exit_code=local.run(run_dir, total_steps=steps, held=held))
        said: list[str] = []  # the launcher's last line goes to the caller with the output, not to stderr
        code = local.run(run_dir, out=out, held=held, report=said.append)
        if said:
            out.write(f"{said[-1]}\n".encode())
        return Launched(exit_code=code, message=said[-1] if said else "")

    def states(self, records: dict[Path, dict]) -> dict[Path, StateTuple]:
        return {run_dir: state.local_state(run_dir, record) for run_dir, record in records.items()}

    def log_path(self, run_dir: Path, record: dict) -> Path:
        return run_dir / "logs" / "rank0.log"

    def job_label(self, job_id: str) -> str:
        return "the local launch"

    def cancel(self, run_dir: Path, job_id: str) -> None:
        state.cancel_holder(run_dir)


register(LocalBackend())
