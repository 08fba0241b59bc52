"""A built wheel carries the top-level conf/ and recipes/ inside the package (trainctl/conf/, trainctl/recipes/).

A checkout keeps them once, at the top level, where users find and edit them; trainctl.config.sources reads them
there, or from the package when a wheel's build copied them in. setuptools' package-data only globs inside a
package's own folder, so build_py copies the two trees in itself: any YAML under them, so a new group folder or
recipe needs no edit here. The metadata lives in pyproject.toml.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SHIPPED = ("conf", "recipes")  # top-level folders, copied to trainctl/<name>/ in a built package
PACKAGE = "trainctl"
ROOT = Path(__file__).resolve().parent


def shipped_files() -> list[Path]:
    """Every shipped YAML, relative to the repository root."""
    return sorted(p.relative_to(ROOT) for name in SHIPPED for p in (ROOT / name).rglob("*.yaml") if p.is_file())


class BuildWithConfigs(build_py):
    """build_py plus the shipped configs; an editable install reads them from the checkout instead."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:  # build_py builds nothing then: the package is imported from the checkout
            return
        for rel in shipped_files():
            target = Path(self.build_lib, PACKAGE, rel)
            self.mkpath(str(target.parent))
            self.copy_file(str(ROOT / rel), str(target))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        extra = [] if self.editable_mode else [str(Path(self.build_lib, PACKAGE, rel)) for rel in shipped_files()]
        return [*super().get_outputs(include_bytecode), *extra]

    def get_source_files(self) -> list[str]:
        """What an sdist must hold to build the wheel again."""
        return [*super().get_source_files(), *(str(rel) for rel in shipped_files())]


setup(cmdclass={"build_py": BuildWithConfigs})
