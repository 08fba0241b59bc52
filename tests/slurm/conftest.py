"""A real Slurm for these tests: scripts/slurm-local-cluster.sh brings up two nodes once per session.

As root (CI) the fixture installs Debian's Slurm and munge if needed, starts the cluster and
stops it afterwards; a cluster that was already up is reused and left running. Without root
the tests skip, saying why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from trainctl.config.compose import project_root

SCRIPT = project_root() / "scripts" / "slurm-local-cluster.sh"
STATE = Path(os.environ.get("TRAINCTL_SLURM_DIR", "/tmp/trainctl-slurm"))
UP_TIMEOUT_S = 900  # a fresh machine first installs the packages with apt-get


def _two_nodes_up() -> bool:
    if not (STATE / "nodes").is_file() or (STATE / "nodes").read_text().strip() != "2":
        return False
    return subprocess.run([str(SCRIPT), "status"], capture_output=True, timeout=30).returncode == 0


@pytest.fixture(scope="session")
def slurm_cluster():
    """Two idle nodes (node1, node2); SLURM_CONF points the clients at them."""
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root (apt-get, network namespaces, slurmd); run as root or in CI")
    if shutil.which("slurmctld") is None and shutil.which("apt-get") is None:
        pytest.skip("no Slurm installed and no apt-get to install Debian's; "
                    "install slurmctld, slurmd, slurm-client and munge")
    was_up = _two_nodes_up()
    # `up` is idempotent: on a running cluster it only restarts what died and waits for idle nodes.
    done = subprocess.run([str(SCRIPT), "up", "--nodes", "2"], capture_output=True, text=True, timeout=UP_TIMEOUT_S)
    assert done.returncode == 0, f"slurm-local-cluster.sh up failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(STATE / "etc" / "slurm.conf")
    yield STATE
    if previous is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = previous
    if not was_up:
        subprocess.run([str(SCRIPT), "down"], capture_output=True, timeout=120)
