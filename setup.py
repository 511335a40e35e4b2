"""Package layout: one PEP 420 namespace, `prefixcache`, spread over four source roots.

Each of the fixed top-level folders `protos/`, `services/`, `kernels/` and `operator/` holds a
`prefixcache/` folder without an `__init__.py`: a portion of the namespace, as in the Azure and
Google Cloud monorepos. A module's dotted name is its path below its root
(`prefixcache.scheduler.kv_cache.manager` is `services/prefixcache/scheduler/kv_cache/manager.py`),
so any tool that knows the four roots follows every import. `scripts/setup.sh` puts them on the
virtual environment's path.

`build_py` also compiles `protos/**/*.proto` into Python gRPC stubs written next to them (they are
gitignored), so every install, editable ones included, carries stubs matching its .proto files.
"""
import importlib.util
from pathlib import Path

from setuptools import find_namespace_packages, setup
from setuptools.command.build_py import build_py

SOURCE_ROOTS = ("protos", "services", "kernels", "operator")
ROOT = Path(__file__).resolve().parent


def packages_and_dirs() -> tuple[list[str], dict[str, str]]:
    packages: list[str] = []
    package_dir: dict[str, str] = {}
    for root in SOURCE_ROOTS:
        for package in find_namespace_packages(where=root, include=["prefixcache.*"]):
            packages.append(package)
            package_dir[package] = f"{root}/{package.replace('.', '/')}"
    return packages, package_dir


def generate_protos() -> None:
    spec = importlib.util.spec_from_file_location("_codegen", ROOT / "protos" / "_codegen.py")
    codegen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(codegen)
    codegen.generate(ROOT / "protos")


class BuildPyWithProtos(build_py):
    """Generates the gRPC stubs before collecting the modules to install."""

    def run(self) -> None:
        generate_protos()
        super().run()


packages, package_dir = packages_and_dirs()
setup(
    packages=packages,
    package_dir=package_dir,
    cmdclass={"build_py": BuildPyWithProtos},
)
