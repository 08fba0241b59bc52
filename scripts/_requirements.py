"""Print trainctl's requirements from pyproject.toml, one per line: its dependencies and those of the extras named
as arguments (e.g. `python scripts/_requirements.py dev fp8`). scripts/test_torch.sh installs them into a release
venv ahead of trainctl itself. Prints nothing where Python has no tomllib (3.10): the install then resolves them."""

from __future__ import annotations

import sys
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def requirements(extras: list[str], pyproject: Path = PYPROJECT) -> list[str]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        return []
    project = tomllib.loads(pyproject.read_text())["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [extra for extra in extras if extra not in optional]
    if unknown:
        raise SystemExit(f"no extra {unknown[0]!r} in {pyproject}; it has: {', '.join(optional)}")
    return list(dict.fromkeys(project["dependencies"] + [req for extra in extras for req in optional[extra]]))


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1:])))
